#!/usr/bin/env bash
# Step 1 of the GPU check on a lent GPU machine (docs/operations.md, "The GPU check"). That machine's image has
# Python 3.12, torch 2.11 (CUDA 13), torchvision, transformers and triton, and no network; hetero is not
# installed there (its pins would ask for another torch). Run this here, where PyPI is reachable: it puts the
# cp312 wheels of everything else hetero.bench.gpu_check imports (scripts/gpu_wheels.txt, pinned) into
# gpu_wheels/ (ignored by git, about 30 MB; it must stay under the 64 MiB a device call carries), with their
# SHA256SUMS. Step 2: carry gpu_wheels/ with the checkout and run scripts/gpu_check.sh there.
#
#   scripts/gpu_wheels.sh [OUT_DIR]      (HETERO_PYTHON picks the python whose pip downloads; default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu_wheels}"
PYTHON="${HETERO_PYTHON:-python3}"
LIMIT_MIB=60  # a device call carries 64 MiB in all, the checkout included
PARTIAL="$OUT.partial"
mapfile -t REQUIREMENTS < <(awk '!/^#/ && NF {print $1}' scripts/gpu_wheels.txt)
rm -rf "$PARTIAL"
mkdir -p "$PARTIAL"
PIP=("$PYTHON" -m pip --disable-pip-version-check --quiet)
for requirement in "${REQUIREMENTS[@]}"; do
  if ! "${PIP[@]}" download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
      --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d "$PARTIAL" "$requirement" 2>/dev/null; then
    # No cp312 wheel on the index (antlr4-python3-runtime 4.9.3 is an sdist only): build one, and take it
    # only if it is pure Python, so that it installs on any CPython 3.
    echo "gpu_wheels: no wheel for $requirement on the index; building it from its sdist" >&2
    "${PIP[@]}" wheel --no-deps --no-binary=:all: -w "$PARTIAL" "$requirement"
  fi
done
for wheel in "$PARTIAL"/*.whl; do
  case "$wheel" in
    *-py3-none-any.whl | *-py2.py3-none-any.whl | *-cp312-cp312-manylinux*_x86_64.whl) ;;
    *) echo "gpu_wheels: $wheel does not install on CPython 3.12 x86_64" >&2; exit 1 ;;
  esac
done
(cd "$PARTIAL" && sha256sum -- *.whl > SHA256SUMS)
count=$(find "$PARTIAL" -name '*.whl' | wc -l)
if [[ "$count" -ne "${#REQUIREMENTS[@]}" ]]; then
  echo "gpu_wheels: $count wheels for ${#REQUIREMENTS[@]} requirements in scripts/gpu_wheels.txt" >&2
  exit 1
fi
bytes=$(du -sb "$PARTIAL" | cut -f1)
if (( bytes > LIMIT_MIB * 1024 * 1024 )); then
  echo "gpu_wheels: $((bytes / 1024 / 1024)) MiB is over $LIMIT_MIB MiB: make an import lazy rather than carry more" >&2
  exit 1
fi
rm -rf "$OUT"
mv "$PARTIAL" "$OUT"
ls -l "$OUT"
echo "gpu_wheels: ${#REQUIREMENTS[@]} wheels, $(du -sh "$OUT" | cut -f1) in $OUT/ ($bytes bytes); carry it with the checkout"
