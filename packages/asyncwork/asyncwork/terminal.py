"""Text a command prints that came from storage or from a request, made safe for a terminal.

A dead letter's reason can quote a recipient address the provider sent, an operator's ``why`` is
whatever was typed into a form: a terminal obeys the control characters in them (ESC starts a
sequence that retitles the window, clears the screen or rewrites what was printed before; a
line break forges the next line). Every such string a command of the machinery or of the
application prints passes through ``printable`` first, once, where it is formatted.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` unchanged when every character in it is printable; else its escaped form, quoted
    as Python writes it (``'x\\x1b]0;pwned\\x07@example.com'``), so that no C0 or C1 control,
    DEL, line break or other invisible format character reaches the terminal and what was
    stored is still there to read."""
    return text if text.isprintable() else repr(text)
