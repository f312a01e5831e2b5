#!/usr/bin/env bash
# Run the project's ipc tests against real DMA-BUF devices (/dev/dma_heap/system,
# /dev/udmabuf) inside a throw-away VM:
#   - kernel: Debian bookworm-backports linux-image-6.12*-amd64 (CONFIG_UDMABUF=y,
#     CONFIG_DMABUF_HEAPS_SYSTEM=y), fetched with `apt-get download` through a private
#     apt configuration (nothing is installed on the host from it) pointing at the mirror
#     this machine's apt is configured with (apt_sources.py);
#   - initramfs: busybox-static + the virtio-9p modules, built by build_initramfs.py;
#   - qemu-system-x86_64 -accel tcg (works where KVM is absent or cannot boot a stock
#     kernel), host / mounted read-only over 9p (plus any needed folder under the guest's
#     own /tmp or /dev, see guest_shares.py), chroot into it, the venv's python runs
#     pytest, results come back as JUnit XML through a second, writable 9p share.
# Everything is cached in $CACHE (.cache/dmabuf_vm, git-ignored); a warm run boots and
# tests in well under a minute.
#
# Usage: scripts/dmabuf_vm/run.sh [pytest args]   (default: test/test_ipc_*.py)
# Exit: 0 tests passed, 1 tests failed, 2 the VM did not boot or run,
#       77 the VM cannot be provisioned here (no qemu and no way to install it,
#          or no kernel package and no route to Debian's archive); the reason is printed.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
CACHE="${EDGE_LLM_DMABUF_VM_CACHE:-$ROOT/.cache/dmabuf_vm}"
PY="${EDGE_LLM_PYTHON:-$ROOT/.venv/bin/python}"
TIMEOUT_S="${EDGE_LLM_DMABUF_VM_TIMEOUT:-600}"
MEM_MB="${EDGE_LLM_DMABUF_VM_MEM_MB:-2048}"
SMP="${EDGE_LLM_DMABUF_VM_SMP:-2}"
SUITE="${EDGE_LLM_DMABUF_VM_SUITE:-bookworm-backports}"

log() { echo "dmabuf_vm: $*" >&2; }
cannot() { log "cannot provision the VM here: $*"; exit 77; }
die() { log "$*"; exit 2; }

mkdir -p "$CACHE"
find "$CACHE" -maxdepth 1 -name 'run.*' -mtime +1 -exec rm -rf {} + 2>/dev/null || true
# Results and the guest script go to a folder of this run (parallel runs do not collide).
RUN="${EDGE_LLM_DMABUF_VM_RUN_DIR:-$(mktemp -d "$CACHE/run.XXXXXX")}"
mkdir -p "$RUN"
[ -x "$PY" ] || die "python $PY not found: run scripts/setup.sh or set EDGE_LLM_PYTHON"

# --- qemu ------------------------------------------------------------------------------
if ! command -v qemu-system-x86_64 >/dev/null; then
  command -v apt-get >/dev/null || cannot 'qemu-system-x86_64 missing and no apt-get to install it'
  [ "$(id -u)" = 0 ] || cannot 'qemu-system-x86_64 missing; install it: sudo apt-get install qemu-system-x86'
  log 'installing qemu-system-x86 (apt-get)'
  export DEBIAN_FRONTEND=noninteractive
  { apt-get -q update && apt-get install -y -q --no-install-recommends qemu-system-x86; } >&2 \
    || cannot 'apt-get install qemu-system-x86 failed (no route to the archive?)'
fi

# Provisioning below (apt index, downloads, extraction) is shared: one run at a time.
exec 9>"$CACHE/.lock"
flock 9

# --- private apt configuration: only for `apt-get download`, never installs --------------
APT="$CACHE/apt"
mkdir -p "$APT/etc/sources.list.d" "$APT/etc/preferences.d" "$APT/state/lists/partial" \
  "$APT/cache/archives/partial" "$CACHE/debs"
# The archive: the machine's own configured Debian mirror (apt_sources.py reads apt's sources;
# EDGE_LLM_DMABUF_VM_MIRROR overrides it), never a host name written here.
if ! "$PY" "$HERE/apt_sources.py" --suites "${SUITE%%-*}" "$SUITE" \
    > "$APT/etc/sources.list.new"; then
  [ -s "$APT/etc/sources.list" ] \
    || cannot 'no configured apt source for Debian (see above; or set EDGE_LLM_DMABUF_VM_MIRROR)'
  log "keeping the previous run's sources: $(head -1 "$APT/etc/sources.list")"
elif ! cmp -s "$APT/etc/sources.list.new" "$APT/etc/sources.list"; then
  rm -f "$APT/state/lists/"*_Packages*   # another mirror: its index must be fetched anew
  mv "$APT/etc/sources.list.new" "$APT/etc/sources.list"
fi
rm -f "$APT/etc/sources.list.new"
APT_OPTS=(-q -o "Dir::Etc::SourceList=$APT/etc/sources.list"
  -o "Dir::Etc::SourceParts=$APT/etc/sources.list.d" -o "Dir::Etc::Preferences=$APT/etc/preferences"
  -o "Dir::Etc::PreferencesParts=$APT/etc/preferences.d" -o "Dir::State=$APT/state"
  -o "Dir::Cache=$APT/cache" -o Debug::NoLocking=1 -o APT::Sandbox::User=root)

# Refresh the index at most daily; a cached kernel keeps working offline.
if [ -z "$(find "$APT/state/lists" -name '*backports*Packages*' -mtime -1 2>/dev/null)" ]; then
  command -v apt-get >/dev/null || cannot 'apt-get not found (needed to fetch the kernel package)'
  apt-get "${APT_OPTS[@]}" update >&2 || log 'apt-get update failed; trying the cache'
fi

# Kernel package: whatever linux-image-amd64 from $SUITE points at (6.12.x today).
KPKG="$(apt-cache "${APT_OPTS[@]}" show "linux-image-amd64/$SUITE" 2>/dev/null \
  | sed -n 's/^Depends: \(linux-image-6\.[0-9.]*+[a-z0-9]*-amd64\).*/\1/p' | head -1 || true)"
if [ -z "$KPKG" ]; then
  KPKG="$(cat "$CACHE/kernel.pkg" 2>/dev/null || true)"
  [ -n "$KPKG" ] || cannot "no linux-image-amd64 in $SUITE and none cached (no route to the archive?)"
fi
echo "$KPKG" > "$CACHE/kernel.pkg"

fetch() {  # fetch PACKAGE -> path of its .deb in $CACHE/debs
  local pkg="$1" deb
  deb="$(ls "$CACHE/debs/${pkg}_"*.deb 2>/dev/null | head -1 || true)"
  if [ -z "$deb" ]; then
    (cd "$CACHE/debs" && apt-get "${APT_OPTS[@]}" download "$pkg" >&2) \
      || cannot "apt-get download $pkg failed"
    deb="$(ls "$CACHE/debs/${pkg}_"*.deb | head -1)"
  fi
  echo "$deb"
}

KDIR="$CACHE/kernel/$KPKG"
if [ ! -f "$KDIR/.done" ]; then
  deb="$(fetch "$KPKG")"
  rm -rf "$KDIR" && mkdir -p "$KDIR"
  dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$KDIR" --wildcards \
    './boot/vmlinuz-*' './boot/config-*' './lib/modules/*/modules.builtin' \
    './lib/modules/*/kernel/net/9p/*' './lib/modules/*/kernel/fs/9p/*' \
    './lib/modules/*/kernel/fs/netfs/*' 2>/dev/null \
    || dpkg-deb -x "$deb" "$KDIR"   # layout changed: take everything (build_initramfs finds it)
  touch "$KDIR/.done"
fi
VMLINUZ="$(ls "$KDIR"/boot/vmlinuz-* | head -1)"
KCONFIG="$(ls "$KDIR"/boot/config-* | head -1)"
for opt in CONFIG_UDMABUF CONFIG_DMABUF_HEAPS_SYSTEM; do
  grep -q "^$opt=y" "$KCONFIG" || die "$KPKG lacks $opt=y: pick another kernel (EDGE_LLM_DMABUF_VM_SUITE)"
done

BB="$CACHE/busybox/bin/busybox"
if [ ! -x "$BB" ]; then
  deb="$(fetch busybox-static)"
  rm -rf "$CACHE/busybox" && mkdir -p "$CACHE/busybox"
  dpkg-deb -x "$deb" "$CACHE/busybox"
fi

flock -u 9

# --- initramfs (rebuilt each run: < 1 s, follows edits of init.sh) -----------------------
"$PY" "$HERE/build_initramfs.py" --moddir "$(ls -d "$KDIR"/lib/modules/* | head -1)" \
  --busybox "$BB" --init "$HERE/init.sh" --out "$RUN/initrd.gz" >&2

# --- the command run inside the VM (chrooted into the host root) ------------------------
# Default: the ipc tests' DMA-BUF variants (parametrized by allocator name); the memfd
# variants and the allocator-independent tests run on the host.
if [ "$#" -eq 0 ]; then
  set -- $(cd "$ROOT" && ls test/test_ipc_*.py | grep -v test_ipc_dmabuf_vm.py) \
    -k 'udmabuf or dma_heap'
fi
# Emulated CPUs are slow: do on the host what the guest would redo on every run. The
# venv's python re-execs itself to set LD_LIBRARY_PATH (ros_wheels_bootstrapper): compute
# it here and skip that second start; compile and collect here so byte code and pytest's
# rewritten test modules are cached on the (read-only in the guest) host filesystem.
LDPATH="$("$PY" -c 'import os; print(os.environ.get("LD_LIBRARY_PATH", ""))')"
(cd "$ROOT" && "$PY" -m compileall -q edge_llm_ros test >/dev/null \
  && "$PY" -m pytest -q -p no:cacheprovider --collect-only "$@" >/dev/null) \
  || log 'warning: host-side collection failed; the guest will report why'
# Host folders the guest's own /tmp, /dev mounts would hide (a CI clone in /tmp, its venv):
# each becomes a read-only 9p share that init.sh mounts at the same path ($RUN/shares).
SHARES_TXT="$("$PY" "$HERE/guest_shares.py" "$ROOT" "$PY")" \
  || die 'guest_shares.py failed (see above)'
SHARES=()
[ -z "$SHARES_TXT" ] || mapfile -t SHARES <<< "$SHARES_TXT"
: > "$RUN/shares"
qpath() { printf '%s' "${1//,/,,}"; }   # qemu option values escape ',' as ',,'
SHARE_ARGS=()
for i in "${!SHARES[@]}"; do
  fsdev="local,id=x$i,path=$(qpath "${SHARES[$i]}"),security_model=none,readonly=on"
  SHARE_ARGS+=(-fsdev "$fsdev,multidevs=remap" -device "virtio-9p-pci,fsdev=x$i,mount_tag=x$i")
  printf 'x%s %s\n' "$i" "${SHARES[$i]}" >> "$RUN/shares"
  log "sharing ${SHARES[$i]} (under a folder the guest mounts itself)"
done
{
  echo '#!/bin/sh'
  echo "cd '$ROOT' || exit 3"
  echo 'export HOME=/tmp XDG_RUNTIME_DIR=/tmp/xdg PYTHONDONTWRITEBYTECODE=1 EDGE_LLM_REQUIRE_DMABUF=1'
  echo "export EDGE_LLM_IN_DMABUF_VM=1 PATH=/usr/local/bin:/usr/bin:/bin LD_LIBRARY_PATH='$LDPATH'"
  # pytest would scan every installed distribution's metadata for plugins (slow over 9p).
  echo 'export _ROS_WHEELS_BOOTSTRAP_COMPLETE=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1'
  echo "${EDGE_LLM_DMABUF_VM_PRE:-}"   # extra guest commands, for debugging
  echo 'mkdir -p -m 0700 /tmp/xdg'
  echo 'ls -l /dev/dma_heap/ /dev/udmabuf'
  echo 'echo "EDGE_VM_PYTEST_START $(cut -d" " -f1 /proc/uptime)s"'
  printf "'%s' -m pytest -q -p no:cacheprovider -o junit_family=xunit2" "$PY"
  printf ' --junitxml=/tmp/out/junit.xml --color=no -rfEs'

  printf " '%s'" "$@"
  echo
  echo 'rc=$?; echo "EDGE_VM_PYTEST_END $(cut -d" " -f1 /proc/uptime)s"; exit $rc'
} > "$RUN/guest.sh"

boot() {
  timeout "$TIMEOUT_S" qemu-system-x86_64 -accel tcg,thread=multi -cpu max -smp "$SMP" \
    -m "$MEM_MB" -nodefaults -no-user-config -display none -serial stdio -no-reboot \
    -kernel "$VMLINUZ" -initrd "$RUN/initrd.gz" \
    -append 'console=ttyS0 quiet loglevel=3 panic=-1 rdinit=/init mitigations=off' \
    -fsdev local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap \
    -device virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot \
    -fsdev "local,id=out,path=$(qpath "$RUN"),security_model=none" \
    -device virtio-9p-pci,fsdev=out,mount_tag=out "${SHARE_ARGS[@]}" \
    </dev/null | tee "$RUN/console.log"
  return "${PIPESTATUS[0]}"
}

START=$(date +%s.%N)
for attempt in 1 2; do
  log "booting $KPKG under qemu tcg (host / read-only over 9p), attempt $attempt"
  set +e
  boot
  QRC=$?
  set -e
  # Multi-threaded TCG very rarely trips over the kernel patching its own text at boot
  # (an int3 oops before init runs). That says nothing about our code: boot once more.
  grep -q '^EDGE_VM_BOOTED' "$RUN/console.log" && break
  log "the kernel did not reach init (qemu exit $QRC); see $RUN/console.log"
done
END=$(date +%s.%N)
rm -f "$RUN/initrd.gz"
log "VM run took $(awk "BEGIN{printf \"%.1f\", $END - $START}") s (qemu exit $QRC)"
[ "$QRC" = 124 ] && die "VM timed out after ${TIMEOUT_S}s (console: $RUN/console.log)"
STATUS="$(sed -n 's/^EDGE_VM_STATUS=\([0-9]*\).*/\1/p' "$RUN/console.log" | tail -1)"
[ -n "$STATUS" ] || die "the VM did not run the tests (console: $RUN/console.log)"
[ -f "$RUN/junit.xml" ] || die "no JUnit results came back (console: $RUN/console.log)"
log "results: $RUN/junit.xml (pytest exit $STATUS)"
[ "$STATUS" = 0 ] || exit 1
