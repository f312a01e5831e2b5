#!/usr/bin/env bash
# ONNX Runtime's C/C++ API headers for the custom-op library (native/), from a package: the
# PyPI wheel ships libonnxruntime.so without them. Prints the include folder.
# - ORT_INCLUDE_DIR set, or /usr/include/onnxruntime present (the machine's own ONNX Runtime,
#   e.g. Debian/Ubuntu's libonnxruntime-dev or a JetPack build): used as is.
# - Otherwise Debian trixie's libonnxruntime-dev (headers only, ~85 KB), downloaded with a
#   private apt configuration from the machine's configured Debian mirror into
#   .cache/ort_headers/. Headers older than the runtime are fine: the C API is versioned.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/.cache/ort_headers"
die() { echo "ort_headers: $*" >&2; exit 1; }

for dir in "${ORT_INCLUDE_DIR:-}" /usr/include/onnxruntime; do
  if [ -n "$dir" ] && [ -f "$dir/onnxruntime_cxx_api.h" ]; then echo "$dir"; exit 0; fi
done
INCLUDE="$OUT/root/usr/include/onnxruntime"
if [ -f "$INCLUDE/onnxruntime_cxx_api.h" ]; then echo "$INCLUDE"; exit 0; fi

command -v apt-get >/dev/null || die "no ONNX Runtime headers: set ORT_INCLUDE_DIR to a folder with onnxruntime_cxx_api.h (a libonnxruntime-dev package or an ONNX Runtime release's include/)"
# The machine's Debian mirror (deb822 .sources or one-line .list), never a host of ours.
uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
[ -n "$uri" ] || uri=$(awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
[ -n "$uri" ] || die "no Debian mirror in /etc/apt/sources.list*: set ORT_INCLUDE_DIR to ONNX Runtime's headers"
rm -rf "$OUT"; mkdir -p "$OUT/lists/partial" "$OUT/cache/archives/partial"
printf 'Types: deb\nURIs: %s\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' "$uri" > "$OUT/trixie.sources"
apt_opts=(-o "Dir::Etc::sourcelist=$OUT/trixie.sources" -o Dir::Etc::sourceparts=-
          -o "Dir::State::Lists=$OUT/lists" -o "Dir::Cache=$OUT/cache" -o APT::Get::List-Cleanup=0
          -o APT::Sandbox::User=root)
apt-get "${apt_opts[@]}" update -q > "$OUT/apt.log" 2>&1 || { tail -5 "$OUT/apt.log" >&2; die "apt-get update of the trixie suite failed (log: $OUT/apt.log)"; }
(cd "$OUT" && apt-get "${apt_opts[@]}" download libonnxruntime-dev >> "$OUT/apt.log" 2>&1) || { tail -5 "$OUT/apt.log" >&2; die "apt-get download libonnxruntime-dev failed (log: $OUT/apt.log)"; }
dpkg-deb -x "$OUT"/libonnxruntime-dev_*.deb "$OUT/root"
[ -f "$INCLUDE/onnxruntime_cxx_api.h" ] || die "libonnxruntime-dev had no onnxruntime_cxx_api.h"
rm -rf "$OUT/lists" "$OUT/cache"
echo "$INCLUDE"
