"""Progress draws a bar on a terminal and logs every N steps elsewhere, with throughput and ETA."""

from __future__ import annotations

import io
import logging
import re

from alignflow.core.progress import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_logs_every_n_steps_when_not_a_terminal(caplog):
    with caplog.at_level(logging.INFO, logger="alignflow.progress"):
        with progress("sft", total=10, log_every=4, stream=io.StringIO()) as bar:
            for step in range(10):
                bar.update(loss=1.0 / (step + 1), tokens=100)
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split()[1] for line in lines] == ["4/10", "8/10", "10/10"]  # and the last step
    assert "loss=0.25 " in lines[0] and "loss=0.1 " in lines[-1]
    assert re.search(r"[\d,]+ tok/s \| [\d.e+]+ step/s \| elapsed 0:00:00 eta 0:00:00", lines[-1])


def test_resumed_loop_counts_from_its_start(caplog):
    with caplog.at_level(logging.INFO, logger="alignflow.progress"):
        with progress("rl", total=100, initial=90, stream=io.StringIO()) as bar:
            bar.update(5)
            assert bar.n == 95 and bar.line().startswith("rl 95/100 [95%]")
            bar.update(5)
    assert [r.getMessage().split()[1] for r in caplog.records] == ["95/100", "100/100"]  # every total // 20


def test_draws_a_bar_on_a_terminal(caplog):
    screen = Terminal()
    with caplog.at_level(logging.INFO, logger="alignflow.progress"):
        with progress("dpo", total=3, stream=screen) as bar:
            for _ in range(3):
                bar.update(loss=0.5, tokens=10)
    assert not caplog.records
    assert "dpo" in screen.getvalue() and "3/3" in screen.getvalue() and "loss=0.5" in screen.getvalue()
