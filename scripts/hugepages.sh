#!/usr/bin/env bash
# Makes 2 MiB huge pages available for the huge-page tests and benchmark rows: reserves at
# least $SHMSTORE_HUGE_PAGES (default 64, i.e. 128 MiB) in vm.nr_hugepages and mounts a
# hugetlbfs at /tmp/shmstore-hugetlbfs; mounts a tmpfs with transparent huge pages
# (huge=within_size: no reservation, 2 MiB pages where the kernel finds them free) at
# /tmp/shmstore-thp. Needs root; without it (or in a container that forbids it) it says
# what it could not do and exits 0: the tests then skip with a message. It never lowers a
# reservation someone else made.
set -uo pipefail
want=${SHMSTORE_HUGE_PAGES:-64}
mnt=/tmp/shmstore-hugetlbfs
now=$(cat /proc/sys/vm/nr_hugepages 2>/dev/null || echo 0)
if [ "$now" -lt "$want" ]; then
  if echo "$want" 2>/dev/null >/proc/sys/vm/nr_hugepages; then
    echo "hugepages: vm.nr_hugepages $now -> $(cat /proc/sys/vm/nr_hugepages)"
  else
    echo "hugepages: cannot raise vm.nr_hugepages ($now) to $want (not root?): huge-page tests will skip"
  fi
fi
if ! grep -q " $mnt hugetlbfs " /proc/mounts; then
  mkdir -p "$mnt"
  if mount -t hugetlbfs -o pagesize=2M none "$mnt" 2>/dev/null; then
    echo "hugepages: mounted hugetlbfs at $mnt"
  else
    echo "hugepages: cannot mount hugetlbfs at $mnt: named huge-page stores will skip"
  fi
fi
thp=/tmp/shmstore-thp
if ! grep -q " $thp tmpfs " /proc/mounts; then
  mkdir -p "$thp"
  if mount -t tmpfs -o size=1G,huge=within_size none "$thp" 2>/dev/null; then
    echo "hugepages: mounted a tmpfs with transparent huge pages (huge=within_size) at $thp"
  else
    echo "hugepages: cannot mount a THP tmpfs at $thp: transparent huge page tests will skip"
  fi
fi
grep -E '^HugePages_(Total|Free)' /proc/meminfo | tr -s ' ' | paste -sd' ' | sed 's/^/hugepages: /'
exit 0
