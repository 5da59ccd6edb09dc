#!/usr/bin/env bash
# Download, on a machine that reaches a package registry, the wheels that bench/gpu_check.sh installs on an
# offline GPU machine whose image has torch and transformers but not trl, datasets, polars or captum.
#
#   bash bench/fetch_wheels.sh            # -> bench/wheels/{big,polars,rest}/*.whl (ignored by git), prints the sizes
#
# What is fetched is what tokendyn's `train` / `analyze` path imports beyond torch + transformers and their own
# dependencies, resolved by pip in a scratch venv that holds only those two (as the image does), for CPython 3.11
# manylinux x86_64. captum is left out: only the tests import it. pyarrow (datasets imports it) is ~55 MB by
# itself and polars' runtime ~54 MB, so the wheels are split in three folders, each under 64 MiB, for a copy to
# the GPU machine that takes at most 64 MiB at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DEST=bench/wheels
SCRATCH=${SCRATCH:-/tmp/tokendyn-gpuimg}
TORCH=${TORCH:-torch==2.13.0}
TRANSFORMERS=${TRANSFORMERS:-transformers==5.24.0}
NEEDED=("trl>=1.16,<1.17" "accelerate>=1.0" "datasets>=3.0" "polars>=1.0" "pyarrow>=15" "rich>=13" "pyyaml>=6")

if [ ! -x "$SCRATCH/bin/python" ]; then
  "$PY" -m venv "$SCRATCH"
  "$SCRATCH/bin/pip" install -q "$TORCH" "$TRANSFORMERS"
fi
# what pip would add to an image with only torch + transformers
"$SCRATCH/bin/pip" install -q --dry-run --report "$SCRATCH/report.json" "${NEEDED[@]}" >/dev/null
mapfile -t PINS < <("$SCRATCH/bin/python" - "$SCRATCH/report.json" <<'EOF'
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    if meta["name"].lower() not in ("torch", "transformers"):
        print(f"{meta['name']}=={meta['version']}")
EOF
)
rm -rf "$DEST"
mkdir -p "$DEST/big" "$DEST/polars" "$DEST/rest"
PLATFORM=(--only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
  --platform any)
"$PY" -m pip download -q --no-deps -d "$DEST/rest" "${PLATFORM[@]}" "${PINS[@]}" 2>&1 | grep -v "is ignored" || true
mv "$DEST"/rest/pyarrow-*.whl "$DEST/big/"
mv "$DEST"/rest/polars_runtime*.whl "$DEST/polars/" 2>/dev/null || true
echo "wheels for the GPU image (beyond torch + transformers):"
for d in "$DEST/big" "$DEST/polars" "$DEST/rest"; do
  ls "$d" | sed 's/^/  /'
  echo "  $d: $(du -cb "$d"/*.whl | tail -1 | cut -f1) bytes"
done
echo "total: $(du -cb "$DEST"/*/*.whl | tail -1 | cut -f1) bytes (each folder must stay under 64 MiB = 67108864)"
