"""Memory-limited child processes (docs/design.md §8): every benchmark configuration, and every mode of `make demo`, runs
in its own process inside a memory cgroup (page cache counted) whose limit is the process's baseline plus the
configuration's DRAM budget; the cgroup's peak proves the budget. cgroup v1 (/sys/fs/cgroup/memory) or v2; where
neither can be created (no root, no hierarchy) the child still runs and the facts say why nothing was enforced."""

from __future__ import annotations

import os

CGROUP_V1 = "/sys/fs/cgroup/memory"
CGROUP_V2 = "/sys/fs/cgroup"


def drop_page_cache() -> None:
    """Write back dirty pages and drop the page cache (root only; a no-op otherwise)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


class MemoryCgroup:
    """A fresh memory cgroup (v1 at /sys/fs/cgroup/memory, else v2) with a limit; removed by `close`.

    `unavailable` is None when it works, else why not (then `limit_bytes` is not enforced)."""

    def __init__(self, name: str, limit_bytes: int | None):
        self.limit_bytes, self.path, self.version, self.unavailable = limit_bytes, None, 0, None
        if os.path.isfile(os.path.join(CGROUP_V1, "memory.limit_in_bytes")):
            root, self.version, limit_file = CGROUP_V1, 1, "memory.limit_in_bytes"
        elif os.path.isfile(os.path.join(CGROUP_V2, "cgroup.controllers")):
            root, self.version, limit_file = CGROUP_V2, 2, "memory.max"
        else:
            self.unavailable = "no memory cgroup hierarchy mounted (v1 or v2)"
            return
        path = os.path.join(root, name)
        try:
            os.mkdir(path)
            if limit_bytes is not None:
                self._write(path, limit_file, str(limit_bytes))
        except OSError as e:
            self.unavailable = f"cannot create a memory cgroup under {root}: {e}"
            if os.path.isdir(path):
                os.rmdir(path)
            return
        self.path = path

    @staticmethod
    def _write(path: str, name: str, value: str) -> None:
        with open(os.path.join(path, name), "w") as f:
            f.write(value)

    def _read(self, name: str) -> str | None:
        try:
            with open(os.path.join(self.path, name)) as f:
                return f.read()
        except OSError:
            return None

    def enter(self) -> None:
        """Move the calling process into the group (a subprocess preexec_fn: the child is charged from exec on)."""
        if self.path is not None:
            self._write(self.path, "cgroup.procs", str(os.getpid()))

    def peak_bytes(self) -> int | None:
        text = self._read("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak")
        return None if text is None else int(text)

    def oom_kills(self) -> int | None:
        """OOM kills inside the group (v1 memory.oom_control 'oom_kill', v2 memory.events 'oom_kill')."""
        text = self._read("memory.oom_control" if self.version == 1 else "memory.events")
        for line in (text or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return None

    def failcnt(self) -> int | None:
        text = self._read("memory.failcnt") if self.version == 1 else None
        return None if text is None else int(text)

    def close(self) -> None:
        if self.path is not None:
            os.rmdir(self.path)  # the child has exited; its page-cache charges move to the parent group
            self.path = None


def run_limited_child(
    argv: list[str], budget_bytes: int | None, baseline_bytes: int | None, name: str, timeout_s: float = 1800
) -> tuple[list[dict], dict]:
    """Run `argv` (a child that prints JSON rows) in a fresh memory cgroup limited to baseline + budget, after
    dropping the page cache. Returns (the child's JSON rows, the cgroup facts: cgroup_limit_mb, cgroup_peak_mb,
    oom_killed, cgroup_failcnt, exit_status, cgroup_note). No budget or baseline: no limit, the peak is still
    measured."""
    import json
    import subprocess

    limit = None if budget_bytes is None or baseline_bytes is None else baseline_bytes + budget_bytes
    drop_page_cache()
    group = MemoryCgroup(f"flashllm-{name}-{os.getpid()}", limit)
    try:
        try:
            proc = subprocess.run(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                timeout=timeout_s,
                preexec_fn=group.enter,
            )
        except subprocess.TimeoutExpired as e:  # run() has killed the child: report it as a row
            proc = subprocess.CompletedProcess(argv, -9, e.stdout or "", f"timed out after {timeout_s:g} s (killed)")
            proc.stdout = proc.stdout.decode() if isinstance(proc.stdout, bytes) else proc.stdout
        oom = group.oom_kills()
        facts = {
            "cgroup_limit_mb": None if limit is None or group.unavailable else limit / 1e6,
            "cgroup_peak_mb": None if group.unavailable else group.peak_bytes() / 1e6,
            "oom_killed": bool(oom),
            "cgroup_failcnt": group.failcnt(),
            "exit_status": proc.returncode,
            "cgroup_note": group.unavailable,
        }
    finally:
        group.close()
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 and not any("error" in r for r in rows):
        rows.append({"error": f"child exited with status {proc.returncode}: {proc.stderr.strip()[-400:]}"})
    return rows, facts
