"""The llama-cpp-python environment of the llama.cpp peer: built once, reused while its stamp matches."""

import json

import pytest

from flashllm_ext.harness.llama_cpp import CMAKE_ARGS, LLAMA_CPP_VERSION, ensure_env, env_ready


def test_env_is_ready_only_with_the_stamp_of_this_version_and_cmake_args(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    assert not env_ready(tmp_path)
    stamp = tmp_path / "flashllm-build.json"
    stamp.write_text(json.dumps({"llama_cpp_python": LLAMA_CPP_VERSION, "cmake_args": CMAKE_ARGS}))
    assert env_ready(tmp_path) and not env_ready(tmp_path, cmake_args="-DGGML_NATIVE=OFF")
    stamp.write_text(json.dumps({"llama_cpp_python": "0.3.1", "cmake_args": CMAKE_ARGS}))
    assert not env_ready(tmp_path)


def test_ensure_env_never_empties_a_folder_of_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="no virtual environment"):
        ensure_env(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_failed_build_names_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # offline: pip finds no llama-cpp-python and fails in seconds
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    env = tmp_path / "venv"
    with pytest.raises(RuntimeError, match=f"failed .* see {env / 'build.log'}"):
        ensure_env(env)
    assert (env / "build.log").stat().st_size > 0 and not env_ready(env)
