#!/usr/bin/env bash
# Fetch (here, where a package index is reachable) the wheels the device check's host lacks, for its
# Python 3.12 on x86-64 Linux: helios' runtime dependencies that the host's image does not hold
# (it has torch 2.11, triton, transformers, numpy, safetensors, tokenizers, jinja2, typer, rich,
# httpx, anyio, click, h11, pyyaml, pillow, prometheus-client, huggingface-hub, ...). The versions
# are the ones this project is tested with. benchmarks/gpu_check.sh installs them from the folder.
#
#   bash benchmarks/gpu_wheels.sh [DIR]      # DIR: .whl (in the repository root) unless given
#
# The folder travels with the working tree to the device host (carried: name it in the run's
# carry list), so the wheels and the tree together must stay under 64 MiB; the script checks both.
set -eu -o pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-$REPO/.whl}
PY=${PYTHON:-$([[ -x $REPO/.venv/bin/python ]] && echo "$REPO/.venv/bin/python" || echo python3)}
LIMIT=$((64 << 20))
WHEELS=(
    msgspec==0.23.0
    llguidance==1.9.1
    litestar==2.25.0 # and its dependencies the image lacks:
    litestar-htmx==0.5.0
    multipart==2.0.1
    polyfactory==3.5.0
    faker==40.63.0
    rich-click==1.9.9
    sniffio==1.3.1
    uvicorn==0.55.0
    gguf==0.19.0
    deepseek-recipe==0.2.0
    brotli==1.2.1
    zstandard==0.25.0
)

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${WHEELS[@]}"

# Inside the repository the folder must be ignored by git (it then travels only when carried).
case "$DEST" in
"$REPO"/*)
    entry="/${DEST#"$REPO"/}/"
    grep -qxF "$entry" "$REPO/.git/info/exclude" 2>/dev/null || echo "$entry" >>"$REPO/.git/info/exclude"
    ;;
esac

wheels=$(cat "$DEST"/*.whl | wc -c)
tree=$(cd "$REPO" && git ls-files -z --cached --others --exclude-standard | xargs -0 cat 2>/dev/null | wc -c)
ls -l "$DEST"
echo "wheels: $((wheels >> 10)) KiB in $(ls "$DEST"/*.whl | wc -l) files; working tree: $((tree >> 10)) KiB;" \
    "together $(((wheels + tree) >> 10)) KiB of the $((LIMIT >> 10)) KiB a device run carries"
if ((wheels + tree > LIMIT)); then
    echo "gpu_wheels: over the 64 MiB a device run carries" >&2
    exit 1
fi
