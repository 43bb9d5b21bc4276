"""EpisodePins: an episode keeps its first version for episode_pin_s after its first call; the
versions it holds count as in use until it is forgotten (then, or pushed out by newer episodes)."""

from __future__ import annotations

from services.explorer.serving.episodes import EpisodePins


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_an_episode_keeps_its_version_for_a_while_after_its_first_call():
    clock = Clock()
    pins = EpisodePins(ttl_s=10, max_episodes=100, clock=clock)
    assert pins.get("a", "t", "0") is None
    pins.remember("a", "t", "0", 3)
    for _ in range(3):  # later calls do not extend it: a task_id + run_id reused forever still moves on
        clock.t += 3
        assert pins.get("a", "t", "0") == 3
        pins.remember("a", "t", "0", 3)
    assert pins.held("a") == {3} and pins.held("b") == set()
    clock.t += 1.5
    assert pins.get("a", "t", "0") is None and pins.held("a") == set() and len(pins) == 0
    pins.remember("a", "t", "0", 4)  # its next call starts a new pin on the version current then
    clock.t += 9
    assert pins.get("a", "t", "0") == 4


def test_held_versions_are_counted_per_episode():
    clock = Clock()
    pins = EpisodePins(ttl_s=10, max_episodes=100, clock=clock)
    pins.remember("a", "t", "0", 3)
    pins.remember("a", "t", "1", 3)
    pins.remember("a", "u", "0", 4)
    assert pins.held("a") == {3, 4}
    pins.forget("a", "t", "0")
    assert pins.held("a") == {3, 4}
    pins.forget("a", "t", "1")
    assert pins.held("a") == {4}
    pins.remember("a", "u", "0", 5)  # moved on (its version was deleted): v4 is no longer held
    assert pins.held("a") == {5}


def test_the_oldest_episodes_go_first_when_too_many_are_remembered():
    changes = []
    pins = EpisodePins(ttl_s=100, max_episodes=2, clock=Clock(), on_change=lambda: changes.append(1))
    pins.remember("a", "t", "0", 1)
    pins.remember("a", "t", "1", 2)
    pins.remember("a", "t", "0", 1)  # a later call of the oldest: no change, still the oldest
    pins.remember("a", "t", "2", 3)
    assert pins.get("a", "t", "0") is None and pins.get("a", "t", "1") == 2 and pins.get("a", "t", "2") == 3
    assert pins.held("a") == {2, 3} and len(changes) == 3


def test_off_when_the_window_is_zero():
    assert not EpisodePins(ttl_s=0, max_episodes=10).enabled
