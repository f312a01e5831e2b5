#!/bin/busybox sh
# PID 1 of the DMA-BUF test VM: mount the host root read-only over virtio-9p, the
# run folder (guest.sh in, results out) read-write, the extra shares listed in its
# "shares" file read-only at their host paths, chroot into the host root and
# run guest.sh there, then power off. Any failure powers off with a message.
/bin/busybox mkdir -p /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
export PATH=/bin:/sbin:/usr/bin:/usr/sbin

fail() {
  echo "EDGE_VM_FAIL: $*"
  poweroff -f
}

mount -t devtmpfs dev /dev || fail 'devtmpfs'
mount -t proc proc /proc
mount -t sysfs sys /sys
for m in $(cat /lib/modules/order); do
  insmod "/lib/modules/$m" || fail "insmod $m"
done
OPTS=trans=virtio,version=9p2000.L,msize=1048576
mount -t 9p -o "$OPTS,ro,cache=loose" hostroot /host || fail 'mount host root over 9p'
mount -t proc proc /host/proc || fail 'proc in host root'
mount -t sysfs sys /host/sys
mount -t devtmpfs dev /host/dev || fail 'devtmpfs in host root'
mkdir -p /host/dev/shm /host/dev/pts
mount -t tmpfs -o mode=1777 shm /host/dev/shm
mount -t tmpfs -o mode=1777 tmp /host/tmp || fail 'tmpfs /tmp'
mkdir -p /host/tmp/out
mount -t 9p -o "$OPTS" out /host/tmp/out || fail 'mount run folder over 9p'
# Host folders the tmpfs above (or /dev) hides, e.g. a checkout in /tmp: "tag path" lines.
while read -r tag path; do
  mkdir -p "/host$path" || fail "mkdir $path"
  mount -t 9p -o "$OPTS,ro,cache=loose" "$tag" "/host$path" || fail "mount $path over 9p"
done < /host/tmp/out/shares
echo "EDGE_VM_BOOTED $(cut -d' ' -f1 /proc/uptime)s kernel $(uname -r)"
chroot /host /bin/sh /tmp/out/guest.sh
echo "EDGE_VM_STATUS=$?"
sync
umount /host/tmp/out
poweroff -f
