from flashllm_ext.harness.timing import time_interleaved


def test_rounds_rotate_the_order_and_run_each_candidate_equally():
    calls = []
    medians = time_interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=4, warmup=1, min_seconds=0.0
    )
    assert set(medians) == {"a", "b"} and all(m >= 0 for m in medians.values())
    # per candidate: one warm-up call, one calibration call, then one call per round (min_seconds=0 -> 1 call)
    assert calls.count("a") == calls.count("b") == 6
    rounds = [calls[i : i + 2] for i in range(4, 12, 2)]
    assert ["a", "b"] in rounds and ["b", "a"] in rounds


def test_a_slower_candidate_gets_a_larger_median():
    import time

    medians = time_interleaved({"fast": lambda: None, "slow": lambda: time.sleep(0.002)}, rounds=3, min_seconds=0.0)
    assert medians["slow"] > medians["fast"] and medians["slow"] >= 0.002
