#!/usr/bin/env bash
# One Serve run on the GPU machine: bash devrun.sh NAME MPS PCT  (env: LEVELS REQUESTS RAMP LISTEN LISTENREQ
# OPEN EXTRA_SED BUDGET). Wheel parts must be in /tmp/rayparts (carried .ray* folders, copied there).
set -u
NAME=$1; MPSV=${2:-1}; PCT=${3:-90}
for d in .rayA1 .rayA2 .rayB1 .rayB2; do [ -d $d ] && mkdir -p /tmp/rayparts && cp $d/* /tmp/rayparts/; done
CFG=/tmp/cfg-$NAME.yaml
sed -e "s/CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: \"90\"/CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: \"$PCT\"/" ${EXTRA_SED:+-e "$EXTRA_SED"} config/serve-h200.yaml > $CFG
diff config/serve-h200.yaml $CFG
OUT=$OUT/$NAME CONFIG=$CFG PHASES=${PHASES:-serve} PIPE_LISTEN=${PIPE_LISTEN:-0} PIPE_LEVELS=${PIPE_LEVELS:-1} PIPE_REQUESTS=${PIPE_REQUESTS:-6} PIPE_RAMP_S=${RAMP:-8.5} LEVELS=${LEVELS:-1} REQUESTS=${REQUESTS:-6} \
  LISTEN_LEVELS=${LISTEN:-} LISTEN_REQUESTS=${LISTENREQ:-} RAMP_S=${RAMP:-8.5} OPEN_RATES=${OPEN:-} \
  MPS=$MPSV BUDGET_S=${BUDGET:-560} bash bench/h200_e2e.sh > /tmp/devrun-$NAME.log 2>&1
gzip -f $OUT/$NAME/serve_app.log 2>/dev/null
tail -5 /tmp/devrun-$NAME.log; cat $OUT/$NAME/digest.txt
tar czf $OUT/$NAME.tgz -C $OUT $NAME && rm -rf $OUT/$NAME
