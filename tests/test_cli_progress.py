"""The progress bar on a terminal: a note or a warning printed while the bar is drawn starts on
a clean line (the bar is a line without its newline; "\r" + text only overwrote its start, and a
warning was glued onto its end), and the bar is drawn again below it."""
from __future__ import annotations

import io
import sys
import warnings

import pytest

from recc.app.training import Progress


class Terminal(io.StringIO):
    """stderr as a terminal: ``screen()`` is what it shows (\r, erase-to-end-of-line, \n)."""

    def isatty(self) -> bool:
        return True

    def screen(self) -> list[str]:
        lines, line, col = [], [], 0
        text, i = self.getvalue(), 0
        while i < len(text):
            if text.startswith("\033[K", i):
                del line[col:]
                i += 3
                continue
            c = text[i]
            if c == "\r":
                col = 0
            elif c == "\n":
                lines.append("".join(line))
                line, col = [], 0
            else:
                if col < len(line):
                    line[col] = c
                else:
                    line.append(c)
                col += 1
            i += 1
        return lines + (["".join(line)] if line else [])


@pytest.fixture
def terminal(monkeypatch):
    """A terminal as stderr. (Set in the test's body: pytest puts its own capture back on
    sys.stderr between a fixture's setup and the test.)"""
    return lambda: _terminal(monkeypatch)


def _terminal(monkeypatch) -> Terminal:
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)

    def show(message, category, filename, lineno, file=None, line=None):
        sys.stderr.write(f"{category.__name__}: {message}\n")  # what warnings prints, without the path
    monkeypatch.setattr(warnings, "showwarning", show)
    return term


def test_a_note_starts_on_a_clean_line_and_the_bar_is_drawn_again(terminal):
    terminal = terminal()
    bar = Progress(10)
    bar.update(3, "loss 0.6931 12,345 samples/s", force=True)
    bar.note("step 3: checkpoint")
    bar.update(10, "loss 0.5000 12,345 samples/s")
    bar.close()
    assert terminal.screen() == ["step 3: checkpoint",
                                 "[##############################] 10/10 loss 0.5000 12,345 samples/s"]


def test_a_warning_while_the_bar_is_drawn_starts_on_a_clean_line(terminal):
    terminal = terminal()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        bar = Progress(10)
        bar.update(4, "loss 0.6000", force=True)
        warnings.warn("slow disk")
        bar.close()
    assert terminal.screen() == ["UserWarning: slow disk", "[############..................] 4/10 loss 0.6000"]


def test_close_gives_warnings_its_printer_back(terminal):
    terminal = terminal()
    before = warnings.showwarning
    bar = Progress(5)
    assert warnings.showwarning != before
    bar.close()
    bar.close()
    assert warnings.showwarning == before


def test_not_a_terminal_prints_plain_lines(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    bar = Progress(4)
    bar.update(2, "loss 1.0", force=True)
    bar.note("a note")
    bar.close()
    assert out.getvalue() == "[###############...............] 2/4 loss 1.0\na note\n"
