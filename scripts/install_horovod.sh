#!/usr/bin/env bash
# Builds Horovod 0.28.1 (TensorFlow + Gloo, CPU only) from its sdist and installs it
# into the environment of the given Python.
#
#   bash scripts/install_horovod.sh [PYTHON]      (default: .venv/bin/python)
#
# Why a script: `pip install horovod` fails against TF 2.21. The sdist needs
#   1. a one-line guard in horovod/tensorflow/xla_mpi_ops.cc (its XLA headers moved in
#      TF >= 2.16; the XLA ops are only needed for GPU builds),
#   2. cmake < 4 from PyPI and CMAKE_POLICY_VERSION_MINIMUM=3.5 (old cmake_minimum_required),
#   3. a HOROVOD_CMAKE wrapper that disables CUDA on configure: machines with nvcc on
#      PATH but no cudart otherwise fail with "Couldn't find CUDA library root",
#   4. --no-build-isolation, so it compiles against the installed TensorFlow,
#   5. a one-line fix in horovod/common/gloo/gloo_context.cc: a process set's Gloo
#      device ignored HOROVOD_GLOO_IFACE (it read its own, empty, interface name) and
#      bound to whatever the host name resolves to, e.g. 127.0.0.1, so ranks on hosts
#      whose name does not resolve to their TF_CONFIG address aborted.
# Idempotent: does nothing when `import horovod.tensorflow` already works and the
# installed build carries this script's patch level (PATCH_LEVEL below).
# Takes ~3-4 minutes on 2 cores.
set -euo pipefail

PY="${1:-.venv/bin/python}"
HOROVOD_VERSION="${HOROVOD_VERSION:-0.28.1}"
PATCH_LEVEL="tfdist-2"  # bump when a patch changes, so older builds are rebuilt
log() { echo "[install_horovod] $*"; }

if [ ! -x "$PY" ]; then
    log "ERROR: python not found or not executable: $PY"
    exit 2
fi
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"

check_import() {
    "$PY" - "$PATCH_LEVEL" <<'EOF' 2>/dev/null
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import pathlib, sys
import horovod.tensorflow as hvd
marker = pathlib.Path(__import__("horovod").__file__).parent.parent / "TFDIST_PATCH_LEVEL"
level = marker.read_text().strip() if marker.exists() else "none"
if level != sys.argv[1]:
    sys.exit(f"horovod patch level {level}, wanted {sys.argv[1]}")
print(f"horovod {__import__('horovod').__version__}: gloo built={hvd.gloo_built()}, "
      f"patches {level}")
EOF
}

if check_import; then
    log "horovod.tensorflow (patch level $PATCH_LEVEL) already imports with $PY; nothing to do."
    exit 0
fi

log "building horovod==$HOROVOD_VERSION for $PY ($("$PY" -c 'import tensorflow as tf; print("tensorflow", tf.__version__)' 2>/dev/null || echo 'tensorflow missing'))"
"$PY" -c 'import tensorflow' 2>/dev/null || { log "ERROR: TensorFlow must be installed in $PY's environment first."; exit 2; }

# A wheel built here is kept, as pip keeps the wheels it builds, under a key of what it
# was built from and for (this script's text included), and installed again when the
# key matches: a second clone on the same machine skips the 2-minute compile.
BUILT_FOR="$("$PY" -c 'import platform, sys, tensorflow as tf; print(f"py{sys.version_info[0]}{sys.version_info[1]}-tf{tf.__version__}-{platform.machine()}")' 2>/dev/null)"
SCRIPT_HASH="$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-12)"
WHEEL_CACHE="${TFDIST_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tfdist/wheels}/horovod-$HOROVOD_VERSION-$PATCH_LEVEL-$BUILT_FOR-$SCRIPT_HASH"
install_runtime_deps() {
    # horovod's runtime deps (horovodrun needs cloudpickle, psutil, pyyaml).
    "$PY" -m pip install -q cloudpickle psutil pyyaml packaging
    SITE="$("$PY" -c 'import horovod, pathlib; print(pathlib.Path(horovod.__file__).parent.parent)')"
    echo "$PATCH_LEVEL" > "$SITE/TFDIST_PATCH_LEVEL"
}
CACHED="$(ls "$WHEEL_CACHE"/horovod-*.whl 2>/dev/null | head -1 || true)"
if [ -n "$CACHED" ]; then
    log "installing the wheel built before for this key: $CACHED"
    if "$PY" -m pip install -q --no-deps --force-reinstall "$CACHED" && install_runtime_deps \
            && (cd / && check_import); then
        log "done: horovod $HOROVOD_VERSION with Gloo, from $WHEEL_CACHE"
        exit 0
    fi
    log "the kept wheel did not work here; removing it and compiling"
    rm -rf "$WHEEL_CACHE"
fi

WORK="$(mktemp -d -t tfdist-horovod-XXXXXX)"
cleanup() { rm -rf "$WORK"; }
trap cleanup EXIT

log "installing build tools (cmake<4, packaging, wheel) into the target env"
"$PY" -m pip install -q 'cmake<4' packaging wheel setuptools

log "downloading the horovod==$HOROVOD_VERSION sdist"
"$PY" -m pip download -q --no-deps --no-binary :all: -d "$WORK" "horovod==$HOROVOD_VERSION"
SDIST="$(ls "$WORK"/horovod-*.tar.gz)"
tar -xzf "$SDIST" -C "$WORK"
SRC="$WORK/horovod-$HOROVOD_VERSION"

log "patching horovod/tensorflow/xla_mpi_ops.cc (XLA ops only with GPU)"
XLA="$SRC/horovod/tensorflow/xla_mpi_ops.cc"
GUARD='#if TENSORFLOW_VERSION >= 2006000000'
if ! grep -qxF "$GUARD" "$XLA"; then
    log "ERROR: line '$GUARD' not found in $XLA; the patch does not apply to this sdist."
    exit 1
fi
sed -i "s/^#if TENSORFLOW_VERSION >= 2006000000\$/#if TENSORFLOW_VERSION >= 2006000000 \&\& HAVE_GPU/" "$XLA"
grep -qxF "$GUARD && HAVE_GPU" "$XLA" || { log "ERROR: patching $XLA failed."; exit 1; }

log "patching horovod/common/gloo/gloo_context.cc (process sets use HOROVOD_GLOO_IFACE)"
GLOO_CTX="$SRC/horovod/common/gloo/gloo_context.cc"
OLD='  device_attr.iface = gloo_iface_;'
# The first such line after InitializeForProcessSet's start is the process set's device.
LINE="$(grep -n 'void GlooContext::InitializeForProcessSet' "$GLOO_CTX" | cut -d: -f1)"
[ -n "$LINE" ] || { log "ERROR: InitializeForProcessSet not found in $GLOO_CTX"; exit 1; }
TARGET="$(awk -v start="$LINE" -v old="$OLD" 'NR > start && $0 == old { print NR; exit }' "$GLOO_CTX")"
[ -n "$TARGET" ] || { log "ERROR: '$OLD' not found after line $LINE of $GLOO_CTX"; exit 1; }
sed -i "${TARGET}s/.*/  gloo_iface_ = global_context.gloo_iface_;\n  device_attr.iface = gloo_iface_;/" "$GLOO_CTX"
grep -qF 'gloo_iface_ = global_context.gloo_iface_;' "$GLOO_CTX" || { log "ERROR: patching $GLOO_CTX failed."; exit 1; }

# cmake from the target env (PyPI, < 4), wrapped so configure runs never enable CUDA.
CMAKE_BIN="$(dirname "$PY")/cmake"
[ -x "$CMAKE_BIN" ] || { log "ERROR: cmake not found next to $PY ($CMAKE_BIN)"; exit 1; }
log "using $("$CMAKE_BIN" --version | head -1) from $CMAKE_BIN"
WRAPPER="$WORK/cmake"
cat >"$WRAPPER" <<EOF
#!/usr/bin/env bash
# Horovod calls cmake to configure, then with --build; add the CUDA switches to configure only.
case "\${1:-}" in
    --build|--install|-E|--version) exec "$CMAKE_BIN" "\$@" ;;
esac
exec "$CMAKE_BIN" "\$@" -DCMAKE_CUDA_COMPILER=CMAKE_CUDA_COMPILER-NOTFOUND -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=TRUE
EOF
chmod +x "$WRAPPER"

log "compiling (about 3-4 minutes on 2 cores)"
start=$(date +%s)
(
    cd "$SRC"
    HOROVOD_CMAKE="$WRAPPER" \
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    CMAKE_POLICY_VERSION_MINIMUM=3.5 \
    MAKEFLAGS="-j$(nproc)" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PY" -m pip wheel -q --no-build-isolation --no-deps --no-cache-dir -w "$WORK/wheel" "$SRC"
)
WHEEL="$(ls "$WORK"/wheel/horovod-*.whl)"
"$PY" -m pip install -q --no-deps --force-reinstall "$WHEEL"
install_runtime_deps
if mkdir -p "$WHEEL_CACHE" 2>/dev/null && cp "$WHEEL" "$WHEEL_CACHE/"; then
    log "kept the wheel in $WHEEL_CACHE"
fi
log "compiled and installed in $(( $(date +%s) - start ))s"

log "verifying"
cd "$WORK"   # not inside the source tree, so the installed package is imported
if ! check_import; then
    log "ERROR: horovod installed but 'import horovod.tensorflow' fails:"
    "$PY" -c 'import horovod.tensorflow' || true
    exit 1
fi
HVDRUN="$(dirname "$PY")/horovodrun"
[ -x "$HVDRUN" ] || { log "ERROR: horovodrun missing at $HVDRUN"; exit 1; }
log "done: horovod $HOROVOD_VERSION with Gloo; run jobs with $HVDRUN -np 2 -H localhost:2 --gloo"
