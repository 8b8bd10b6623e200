"""Expand SLURM hostlists (``gpu[01-03,07],login5``) without SLURM: the fallback of slurm/common.sh.

    python -m hetero.launch_hosts 'gpu[01-03,07],login5'    # one host per line, in order

The sbatch scripts use ``scontrol show hostnames`` when it exists and this module otherwise (dry runs on a
laptop, CI). Standard library only, and no torch import: it runs before torchrun on every job.

Grammar (what ``scontrol show hostnames`` accepts for ordinary node names): entries are separated by
commas (or whitespace) outside brackets; an entry is a name with zero or more bracket groups, each a
comma list of numbers and ``lo-hi`` ranges. Several groups expand as a product, the last one fastest
(``r[1-2]n[1-2]`` is r1n1 r1n2 r2n1 r2n2); a range keeps the zero padding of its low end (``[08-10]`` is
08 09 10).
"""

from __future__ import annotations

import re
import sys

_NUMBER = re.compile(r"\d+")
_MAX_RANGE = 100_000  # a typo such as [1-1000000000] fails here instead of filling memory


def _bad(text: str, why: str) -> ValueError:
    return ValueError(f"bad SLURM hostlist {text!r}: {why}")


def _split_top_level(text: str) -> list[str]:
    """The entries of ``text``: split on commas and whitespace that are not inside brackets."""
    entries, current, depth = [], [], 0
    for char in text:
        if char == "[":
            if depth:
                raise _bad(text, "nested '['")
            depth = 1
        elif char == "]":
            if not depth:
                raise _bad(text, "']' without '['")
            depth = 0
        elif depth and char.isspace():
            raise _bad(text, "whitespace inside brackets")
        elif not depth and (char == "," or char.isspace()):
            entries.append("".join(current))
            current = []
            continue
        current.append(char)
    if depth:
        raise _bad(text, "'[' without ']'")
    entries.append("".join(current))
    return entries


def _expand_group(text: str, group: str) -> list[str]:
    """``01-03,07`` -> ['01', '02', '03', '07']."""
    values = []
    for part in group.split(","):
        lo, sep, hi = part.partition("-")
        if not _NUMBER.fullmatch(lo) or (sep and not _NUMBER.fullmatch(hi)):
            raise _bad(text, f"[{group}] holds {part!r}, not a number or a lo-hi range")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise _bad(text, f"range {part!r} runs backwards")
        if int(hi) - int(lo) >= _MAX_RANGE:
            raise _bad(text, f"range {part!r} names more than {_MAX_RANGE} hosts")
        width = len(lo)
        values.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return values


def _expand_entry(text: str, entry: str) -> list[str]:
    """``rack[1-2]-gpu[01-02]`` -> the product of its bracket groups, the last group fastest."""
    names = [""]
    for piece in re.split(r"(\[[^\]]*\])", entry):
        if piece.startswith("["):
            values = _expand_group(text, piece[1:-1])
            names = [name + value for name in names for value in values]
        else:
            names = [name + piece for name in names]
    return names


def expand_hostlist(text: str) -> list[str]:
    """The hosts of a SLURM hostlist, in order: ``'gpu[01-02],cpu7'`` -> ['gpu01', 'gpu02', 'cpu7'].

    Raises ValueError naming ``text`` for anything that is not a hostlist (no hosts, unbalanced or nested
    brackets, bracket groups that are not numbers and ``lo-hi`` ranges, ranges that run backwards).
    """
    if not isinstance(text, str) or not text.strip():
        raise _bad(str(text), "no hosts")
    hosts = []
    for entry in _split_top_level(text):
        if entry:  # like scontrol, separators in a row are one separator
            hosts.extend(_expand_entry(text, entry))
    if not hosts:
        raise _bad(text, "no hosts")
    return hosts


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hetero.launch_hosts NODELIST   (e.g. 'gpu[01-03,07],login5')", file=sys.stderr)
        return 2
    try:
        hosts = expand_hostlist(argv[0])
    except ValueError as err:
        print(f"hetero.launch_hosts: {err}", file=sys.stderr)
        return 2
    print("\n".join(hosts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
