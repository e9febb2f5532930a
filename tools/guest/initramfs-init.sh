#!/bin/sh
# /init of the rdmashim guest's initramfs (busybox): load the modules listed in
# /modules.list (virtio disk, ext4 and what they need), mount /dev/vda, and hand
# over to the root file system's /sbin/rdmashim-init.
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
while read -r module; do
    insmod "/modules/$module" 2>/dev/null
done < /modules.list
tries=0
while [ ! -b /dev/vda ] && [ "$tries" -lt 50 ]; do
    sleep 0.1
    tries=$((tries + 1))
done
if ! mount -t ext4 /dev/vda /root; then
    echo "initramfs: /dev/vda does not mount; a shell follows"
    exec sh
fi
umount /proc /sys
mount --move /dev /root/dev
exec switch_root /root /sbin/rdmashim-init
