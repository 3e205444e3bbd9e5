"""When a dead engine is started again (modeswitch.backends.restarts): every time, at once, except in a crash loop,
which waits a backoff that doubles while the loop goes on and starts over once the engine has stayed up."""

from __future__ import annotations

from modeswitch.backends.restarts import RestartPolicy, Restarts
from modeswitch.config import LoadConfig


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_deaths_spread_out_are_restarted_at_once_every_time():
    clock = Clock()
    record = Restarts(RestartPolicy(deaths=3, window_s=60, backoff_s=10, backoff_max_s=40), clock)
    for _ in range(10):  # ten deaths a minute apart: never more than 3 in the window
        assert record.died("killed") == 0 and not record.parked
        assert record.stats()["engine_next_retry_s"] == 0
        record.started()
        assert "engine_next_retry_s" not in record.stats()
        clock.now += 61
    assert record.stats() == {"engine_deaths": 10, "engine_restarts": 10, "engine_parks": 0}


def test_a_crash_loop_parks_with_a_doubling_backoff_that_starts_over():
    clock = Clock()
    record = Restarts(RestartPolicy(deaths=3, window_s=60, backoff_s=10, backoff_max_s=25), clock)
    assert [record.died("killed") for _ in range(3)] == [0, 0, 0]
    assert record.died("killed") == 10  # the 4th death inside 60 s
    assert record.parked and "4 deaths in 60 s (more than 3; last: killed)" in record.parked_reason
    assert record.down_reason("engine x died").startswith("engine x died; crash loop")
    clock.now += 4
    assert record.next_retry_s() == 6
    clock.now += 6
    record.retrying()
    assert not record.parked and record.next_retry_s() == 0
    assert record.died("did not start") == 20  # still looping: twice as long
    assert record.died("did not start") == 25  # capped
    record.started()
    clock.now += 61  # up long enough for its deaths to leave the window
    assert record.died("killed") == 0
    assert [record.died("killed") for _ in range(3)][-1] == 10  # a new loop starts at the first backoff
    assert record.stats()["engine_parks"] == 4 and record.stats()["engine_next_retry_s"] == 10


def test_the_policy_is_read_from_the_load_config():
    load = LoadConfig(crash_loop_deaths=2, crash_loop_window_s=30, crash_loop_backoff_s=5, crash_loop_backoff_max_s=9)
    assert RestartPolicy.of(load) == RestartPolicy(2, 30, 5, 9)
    assert RestartPolicy.of(LoadConfig()) == RestartPolicy()


class Runner:
    """What a served vLLM engine reads of its runner (no vLLM process: ``launch`` is replaced)."""

    def __init__(self, key: str, engine_args: dict) -> None:
        self.engine_args = engine_args
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def death(self) -> str:
        return "its process exited"


def test_a_compiled_engine_that_died_comes_back_eager_and_is_compiled_again_behind(monkeypatch):
    """Loading and warming up compiled graphs is most of a compiled engine's restart: where the server compiles,
    an engine serves eager at once, its modes' cards say so, and it is handed over to be compiled behind the
    requests, also when it dies again before that is done; where the server runs eager, it comes back as it was."""
    import threading

    from modeswitch.backends.vllm import served as served_module

    monkeypatch.setattr(served_module, "launch", Runner)
    behind = []
    compiled = served_module.ServedEngine("fp16", Runner("fp16", {"enforce_eager": False, "model": "m"}), ["fp16"],
                                          threading.Event(), behind.append)
    card = {}
    compiled.cards.append(card)
    assert compiled.resume()
    assert compiled.runner.engine_args == {"enforce_eager": True, "model": "m"} and card["decode"] == "eager"
    assert behind == [compiled]
    assert compiled.fault(stall_s=10) == "vLLM engine fp16 died: its process exited"  # again, still eager
    assert compiled.resume() and compiled.runner.engine_args["enforce_eager"] and behind == [compiled, compiled]

    eager = served_module.ServedEngine("int8", Runner("int8", {"enforce_eager": True}), ["int8"], threading.Event())
    assert eager.resume() and eager.runner.engine_args == {"enforce_eager": True} and len(behind) == 2
