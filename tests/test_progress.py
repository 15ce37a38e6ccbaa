"""Progress reporting: the ETA of a run with warm-up, evaluations and saves."""

import pytest

from shardlm.observe.progress import Eta


def test_eta_lands_within_15_percent_with_warmup_evals_and_saves():
    """Synthetic run: 3 slow warm-up steps (compile), then 0.2 s steps, 1 s evals every 10, 0.5 s saves."""
    total, eta = 100, Eta(100)
    durations = [5.0, 3.0, 2.0] + [0.2] * 97
    for step in range(1, total + 1):
        eta.add_step(durations[step - 1])
        if step % 10 == 0:
            eta.add_eval(1.0)
            eta.add_save(0.5)
        if step >= 5:
            evals_left, saves_left = (total - step) // 10 + 1, (total - step) // 10
            truth = sum(durations[step:]) + evals_left * 1.0 + saves_left * 0.5
            if step >= 10:  # once an eval and a save have been seen
                assert eta.remaining(step, evals_left, saves_left) == pytest.approx(truth, rel=0.15)
