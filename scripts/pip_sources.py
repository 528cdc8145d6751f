"""Prints pip's configured package sources as uv flags, one per line, for scripts/setup.sh.

uv reads none of pip's configuration (pip.conf, PIP_* variables); a machine whose packages come from a mirror, a
wheel folder or under a constraints file says so to pip, and setup.sh must install from the same sources whichever
installer runs. `pip config list` prints every scope's values (files and environment) as `scope.key='value'`.
"""

from __future__ import annotations

import ast
import subprocess
import sys

# pip's option -> uv's flag; a value may hold several entries separated by white space, as pip reads them
FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
# pip takes an option from the strongest scope that sets it: PIP_* variables, the PIP_CONFIG_FILE file, then the
# site, user and global files (pip's OVERRIDE_ORDER, read backwards)
PRECEDENCE = (":env:", "env", "site", "user", "global")


def uv_flags(pip_config_list: str) -> list[str]:
    """The flags for uv from `pip config list`'s lines, each option from the scope pip itself would take it from."""
    chosen: dict[str, tuple[int, str]] = {}
    for line in pip_config_list.splitlines():
        key, _, quoted = line.partition("=")
        scope, _, option = key.rpartition(".")
        if option not in FLAGS or scope not in PRECEDENCE or not quoted:
            continue
        rank = PRECEDENCE.index(scope)
        if option not in chosen or rank < chosen[option][0]:
            chosen[option] = (rank, ast.literal_eval(quoted))
    return [part for option, (_, value) in chosen.items() for entry in value.split() for part in (FLAGS[option], entry)]


if __name__ == "__main__":
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    print("\n".join(uv_flags(listed)))
