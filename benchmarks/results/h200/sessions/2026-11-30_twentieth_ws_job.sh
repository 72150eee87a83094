# the smoke pass, restarted past any configuration that hangs, then the timing of those that ran
cd benchmarks/results/h200/sessions
export WS_SKIP=""
for attempt in 1 2 3 4; do
  timeout 60 python3 2026-11-30_twentieth_gluon_ws.py --smoke 8192 > $OUT/smoke_$attempt.log 2>&1 && break
  hung=$(python3 -c "
import json,sys
ev=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
st=[e['start'] for e in ev if 'start' in e]; dn=[e['done'] for e in ev if 'done' in e]
print(','.join(x for x in st if x not in dn))" $OUT/smoke_$attempt.log)
  echo "attempt $attempt hung or failed at: $hung"; tail -3 $OUT/smoke_$attempt.log
  [ -z "$hung" ] && break
  export WS_SKIP="$WS_SKIP,$hung"
done
echo "skip: $WS_SKIP"
timeout 200 python3 2026-11-30_twentieth_gluon_ws.py --time 8192 2>&1 | grep -v Warning | tee $OUT/ws_8192.log
