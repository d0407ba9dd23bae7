#!/bin/busybox sh
# PID 1 of the kernel-matrix guests (`cargo xtask vm-test`, xtask/src/vm/).
#
# Mounts what the tests need (proc, sys, dev, cgroup2, bpffs, tmpfs on /tmp
# and /run with /run/netns), loads the modules the kernel lacks, brings
# loopback up, runs each test binary named in /etc/dp/suite and reports on
# the second serial port (/dev/ttyS1), one record per line:
#
#   @@dp kernel <release>
#   @@dp module <file> <exit status of insmod>
#   @@dp begin <test binary>
#   <the binary's output>
#   @@dp end <test binary> <exit status> <seconds>
#   @@dp done
#
# then powers the guest off. RLIMIT_MEMLOCK stays at the kernel's default
# on purpose: the agent and the tests must cope with it themselves (it
# counts BPF memory before 5.11).

/bin/busybox --install -s /bin
export PATH=/bin HOME=/tmp TMPDIR=/tmp RUST_BACKTRACE=0

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mkdir -p /run/netns /sys/fs/cgroup /sys/fs/bpf
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t bpf bpf /sys/fs/bpf

report=/dev/ttyS1
stty -F "$report" raw -echo 2>/dev/null
say() { echo "@@dp $*" > "$report"; }

say kernel "$(uname -r)"
while read -r module; do
    insmod "/lib/modules/dp/$module"
    say module "$module" $?
done < /etc/dp/modules
ip link set lo up

# A binary that hangs is stopped here; the host's time limit is the backstop.
per_binary_limit=$(cat /etc/dp/per-binary-limit)
while read -r binary; do
    say begin "$binary"
    start=$(date +%s)
    timeout "$per_binary_limit" "/dp/deps/$binary" > /tmp/output 2>&1
    status=$?
    cat /tmp/output > "$report"
    say end "$binary" "$status" $(($(date +%s) - start))
done < /etc/dp/suite

say done
sync
poweroff -f
