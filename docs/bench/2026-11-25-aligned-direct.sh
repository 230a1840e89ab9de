#!/usr/bin/env bash
# Aligned O_DIRECT I/O before (09c46d2) and after the bounce layer, interleaved.
set -u
out=/work/wt-bounce/docs/bench/2026-11-25-aligned-direct.txt
: > $out
img=/tmp/bb/disk.img
[ -e $img ] || { dd if=/dev/urandom of=$img bs=1M count=1024 status=none; }
run() { # build label rw bs
    local bin=$1 label=$2 rw=$3 bs=$4 dev=${5:-$img} drv=${6:-file} lbs=${7:-512}
    local sock=/tmp/bb/s.sock; rm -f $sock /tmp/bb/pid
    taskset -c 0 $bin/vsd --blockdev driver=$drv,node-name=f0,filename=$dev,cache.direct=on \
      --blockdev driver=raw,node-name=d0,file=f0 \
      --export type=vhost-user-blk,id=e0,node-name=d0,addr.type=unix,addr.path=$sock,writable=on,num-queues=1,logical-block-size=$lbs \
      --pidfile /tmp/bb/pid & local pid=$!
    for _ in $(seq 100); do [ -e /tmp/bb/pid ] && break; sleep 0.05; done
    local t0=$(awk '{print $14+$15}' /proc/$pid/stat)
    local j=$(taskset -c 1 $bin/vsd-bench --socket $sock --rw $rw --bs $bs --iodepth 32 --seconds 5 --size 1g --json 2>/dev/null)
    local t1=$(awk '{print $14+$15}' /proc/$pid/stat)
    kill $pid; wait $pid 2>/dev/null
    local iops=$(echo "$j" | python3 -c 'import json,sys; d=json.load(sys.stdin)["results"]; print(round(d["iops"]), d["lat_us"]["p50"], d["errors"])' 2>/dev/null)
    local p50=$(echo $iops | cut -d' ' -f2) errs=$(echo $iops | cut -d' ' -f3); iops=$(echo $iops | cut -d' ' -f1)
    local cpu=$(python3 -c "print(round(($t1-$t0)*10000/(5*${iops:-1}),2))")
    echo "$label $drv $rw $bs iops=$iops p50_us=$p50 errors=$errs cpu_us_per_io=$cpu" | tee -a $out
}
for rep in 1 2 3; do
  for w in "randread 4k" "randwrite 4k"; do
    set -- $w
    if [ $((rep % 2)) = 1 ]; then
      run /tmp/vsd-before/target/release before $1 $2; run /work/wt-bounce/target/release after $1 $2
    else
      run /work/wt-bounce/target/release after $1 $2; run /tmp/vsd-before/target/release before $1 $2
    fi
  done
done
loop=$(losetup --sector-size 4096 --find --show $img)
for w in "randread 4k" "randread 512" "randwrite 4k" "randwrite 512"; do
  set -- $w
  run /work/wt-bounce/target/release after-4k-sectors $1 $2 $loop host_device 512
done
losetup -d $loop
