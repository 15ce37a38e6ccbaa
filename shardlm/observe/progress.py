"""The console side of a run: an honest ETA, a progress bar or line, and the wall time of a step; `shardlm eval`'s
progress."""

from __future__ import annotations

import sys
import time


class Eta:
    """Remaining time = steps left x steady step time + evaluations left x eval time + saves left x save time.

    The first `warmup` steps (compile, allocator warm-up) are left out of the step time; the step time is
    the mean over a sliding window so one slow step moves it little.
    """

    def __init__(self, total_steps: int, warmup: int = 3, window: int = 50):
        self.total, self.warmup, self.window = total_steps, warmup, window
        self.step_times: list[float] = []
        self.warm_times: list[float] = []
        self.eval_time: float | None = None
        self.save_time: float | None = None

    def add_step(self, seconds: float) -> None:
        if len(self.warm_times) < self.warmup:
            self.warm_times.append(seconds)
        else:
            self.step_times = (self.step_times + [seconds])[-self.window:]

    def add_eval(self, seconds: float) -> None:
        self.eval_time = seconds if self.eval_time is None else 0.5 * (self.eval_time + seconds)

    def add_save(self, seconds: float) -> None:
        self.save_time = seconds if self.save_time is None else 0.5 * (self.save_time + seconds)

    def remaining(self, step: int, evals_left: int, saves_left: int) -> float | None:
        times = self.step_times or self.warm_times[-1:]  # before steady state: the latest warm-up step
        if not times:
            return None
        per_step = sum(times) / len(times)
        return ((self.total - step) * per_step + evals_left * (self.eval_time or 0.0)
                + saves_left * (self.save_time or 0.0))


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60:02d}:{rem % 60:02d}"


class Progress:
    """A tqdm bar on a terminal; plain lines (one per log interval) when stdout is a file or a pipe."""

    def __init__(self, total: int, mode: str, enabled: bool, initial: int = 0):
        self.enabled = enabled and mode != "none" and total > 0
        self.total, self.began = total, time.time()
        self.bar = None
        if self.enabled and (mode == "bar" or (mode == "auto" and sys.stdout.isatty())):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, file=sys.stdout,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")

    def update(self, step: int, fields: dict[str, str]) -> None:
        if not self.enabled:
            return
        text = " ".join(f"{k} {v}" for k, v in fields.items())
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(text, refresh=True)
        else:
            print(f"step {step}/{self.total} {text} elapsed {fmt_time(time.time() - self.began)}", flush=True)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class StepTimer:
    def __init__(self):
        self.start = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed


class EvalProgress:
    """Tokens scored / total, tokens/s and an ETA on stderr: a tqdm bar on a terminal; otherwise one line after
    the first batch (an early ETA) and then every `every_s` seconds.

    The lines' ETA counts batches or windows, not tokens: a stride's first window scores a whole context,
    the others `stride` tokens each at about the same cost."""

    def __init__(self, total: int, steps: int, every_s: float = 10.0):
        self.total, self.done, self.steps, self.step, self.every_s = total, 0, steps, 0, every_s
        self.start = time.perf_counter()
        self.last: float | None = None
        self.shown = 0  # tokens done at the last line printed
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="tok", unit_scale=True, desc="eval", file=sys.stderr)

    def update(self, tokens: int) -> None:
        self.done, self.step = self.done + tokens, self.step + 1
        if self.bar is not None:
            self.bar.update(tokens)
            return
        now = time.perf_counter()
        if self.last is None or now - self.last >= self.every_s:
            self.last, self.shown = now, self.done
            print(self.line(now), file=sys.stderr, flush=True)

    def line(self, now: float) -> str:
        elapsed = now - self.start
        rate, eta = self.done / max(elapsed, 1e-9), fmt_time(elapsed / self.step * (self.steps - self.step))
        return (f"eval {self.done:,}/{self.total:,} tokens ({100 * self.done / max(self.total, 1):.1f}%)  "
                f"{rate:,.0f} tok/s  ETA {eta}")

    def close(self) -> None:
        """A bar closes; lines end with the last one, so the log does not stop at the first batch's share."""
        if self.bar is not None:
            self.bar.close()
        elif self.last is not None and self.shown < self.done:
            print(self.line(time.perf_counter()), file=sys.stderr, flush=True)
