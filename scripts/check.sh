#!/usr/bin/env bash
# Lint, type-check and test. Run inside the venv that the README's test command makes.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ruff check . || exit 1
# Layout is ruff's (pyproject.toml's [tool.ruff.format]), not hand-wrapped.
ruff format --check . || exit 1
# A '# fmt: skip' / '# fmt: off' says why (a comment of its own on its line, or the line above).
python scripts/check_fmt_skips.py || exit 1
mypy ds_swift launch patches || exit 1
# Every change to DeepSpeed / torch behaviour must live in patches/ (see the script's docstring).
python scripts/check_patch_seams.py || exit 1
# ds-swift's own traffic between ranks goes through ds_swift/transport/ only (host tensors on gloo).
python scripts/check_transport.py || exit 1
# The import graph: recovery/ never imports runtime/, no import circle (contracts in pyproject.toml).
lint-imports || exit 1
# No module over 500 lines, no function over 80 (the older offenders are listed and may only shrink).
python scripts/check_sizes.py || exit 1
# The configuration reference is what the config dataclasses' field docs say now (docs/configuration.md).
python scripts/config_reference.py --check || exit 1
# Every relative link, anchor and repository path named in README.md and docs/ exists.
python scripts/check_links.py || exit 1
# The docs site builds: a broken link or anchor between pages, or a page not in mkdocs.yml's nav, fails.
mkdocs build --strict || exit 1
# Tests marked slow (a variant another CI test covers) run with `bash scripts/check.sh -m slow`.
marker=(-m "not slow")
for a in "$@"; do [[ $a == -m ]] && marker=(); done
tests() {
    python -m pytest -q -p no:cacheprovider "${marker[@]}" "$@"
    local rc=$?
    # pytest exits 5 when it collected no test: that is not a failure of the code.
    if [[ $rc == 5 ]]; then echo "pytest collected no tests"; return 0; fi
    return $rc
}
if [[ $# -gt 0 ]]; then tests "$@"; exit $?; fi
# The single-process tests on both cores (pytest-xdist); the multi-process ones one at a time (each
# starts 4-12 processes of its own on this 2-core machine).
tests -n 2 tests/unit tests/gpu || exit 1
tests tests/dist
