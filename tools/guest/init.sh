#!/bin/bash
# PID 1 of the rdmashim test guest (installed as /sbin/rdmashim-init by build.py).
#
# There is no systemd: this script mounts the kernel file systems, sets up eth0
# from the kernel command line, mounts the host's 9p share at /host (and an
# optional second one at /sync), runs /host/cmd.sh with its output in
# /host/out.log and its status in /host/rc, and powers the machine off.
#
# Command line: rdmashim.name=NAME rdmashim.ip=A.B.C.D/N rdmashim.gw=A.B.C.D
#               rdmashim.shell=1 (a shell on the serial console instead of cmd.sh)
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root TERM=dumb LANG=C.UTF-8

param() {  # the value of rdmashim.$1 on the kernel command line
    local word
    for word in $(cat /proc/cmdline); do
        case $word in rdmashim.$1=*) echo "${word#*=}"; return;; esac
    done
}

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mountpoint -q /dev || mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
mkdir -p /run/lock /run/rpcbind
mount -o remount,rw /
mount -t configfs configfs /sys/kernel/config 2>/dev/null
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
ulimit -l unlimited  # RDMA memory registration pins pages

NAME=$(param name)
hostname "${NAME:-rdmashim-guest}"
printf '127.0.0.1 localhost %s\n' "${NAME:-rdmashim-guest}" > /etc/hosts

ip link set lo up
modprobe virtio_net 2>/dev/null
modprobe virtio_rng 2>/dev/null
ADDR=$(param ip)
if [ -n "$ADDR" ] && ip link show eth0 >/dev/null 2>&1; then
    ip link set eth0 up
    ip addr add "$ADDR" dev eth0
    GW=$(param gw)
    [ -n "$GW" ] && ip route add default via "$GW"
fi

modprobe 9pnet_virtio; modprobe 9p
NINEP=trans=virtio,version=9p2000.L,msize=262144
mount -t 9p -o "$NINEP" host0 /host || echo "rdmashim-init: no host share"
mkdir -p /sync
mount -t 9p -o "$NINEP" sync0 /sync 2>/dev/null  # only when boot.py --sync gave one

if [ "$(param shell)" = 1 ] || [ ! -f /host/cmd.sh ]; then
    echo "rdmashim-init: shell on the console; exit powers off"
    setsid bash -c 'exec bash -i </dev/ttyS0 >/dev/ttyS0 2>&1'
else
    cd /host
    bash /host/cmd.sh > /host/out.log 2>&1
    echo $? > /host/rc.tmp && mv /host/rc.tmp /host/rc
    echo "rdmashim-init: cmd.sh exited $(cat /host/rc)"
fi
sync
umount /host /sync 2>/dev/null
echo o > /proc/sysrq-trigger  # power off at once
sleep 10
busybox poweroff -f
