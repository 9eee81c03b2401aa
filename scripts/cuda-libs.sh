#!/usr/bin/env bash
# Puts the CUDA libraries the cuda device loads at run time (libcuda.so, libnvrtc.so,
# libcublas.so) on LD_LIBRARY_PATH, under the names the loader looks for: a CUDA 13
# install (toolkit or the nvidia-* Python wheels) ships only libnvrtc.so.13 and
# libcublas.so.13, so unversioned links to them go into a temporary folder.
#
#   source scripts/cuda-libs.sh && cargo test -p salus-testkit --test cuda -- --nocapture
links=$(mktemp -d /tmp/salus-culibs.XXXXXX)
for name in libcuda libnvrtc libcublas libcublasLt libnvrtc-builtins; do
    found=$(find /usr/local/nvidia /usr/local/cuda* /usr/lib/x86_64-linux-gnu /opt \
        -name "$name.so*" -not -path "*/stubs/*" 2>/dev/null | sort -r | head -n 1)
    if [ -n "$found" ]; then
        ln -sf "$found" "$links/$name.so"
        for v in 1 12 13; do ln -sf "$found" "$links/$name.so.$v"; done
        dirs="$dirs:$(dirname "$found")"
        echo "cuda-libs: $name -> $found"
    else
        echo "cuda-libs: $name not found"
    fi
done
export LD_LIBRARY_PATH="$links$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
