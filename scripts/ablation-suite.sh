#!/usr/bin/env bash
# Show that each protection's tests fail without its patch: for every row below, revert the
# named patches on top of the full series (`pdsafe-patches ablate`) and run the row's tests
# against that tree. A row passes when the tests FAIL without the patch.
#
# usage: scripts/ablation-suite.sh [ROW-NAME ...]     (default: every row)
# Logs: build/ablation/<row>.log; summary: build/ablation/summary.tsv (docs/ablation.md quotes it)
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
OUT=build/ablation
mkdir -p "$OUT"
export PDSAFE_LOG_DIR=${PDSAFE_LOG_DIR:-$PWD/build/test-logs/ablation}
# A stock server can hold a request for its 300 s timeouts: bound every test.
TIMEOUT=(--timeout "${PDSAFE_ABLATION_TEST_TIMEOUT:-240}")
# Servers start in well under a minute here; a server that must refuse to start but does not
# should fail its test on the assertion, not on the test timeout.
export PDSAFE_STARTUP_TIMEOUT=${PDSAFE_STARTUP_TIMEOUT:-150}

# A row that removes a patch adding a named upstream API (0013, 0016, 0025, 0026) also removes 0032: its
# startup self-check would otherwise refuse to start every server (the fail-closed check doing
# its job), and the row would show a setup error instead of the protection's own assertion.
#
# name | patches to revert | pytest arguments
ROWS=(
  "no-placeholder-unit|0004|test/unit/test_placeholder_guard.py"
  "creation-guard-unit|0005|test/unit/test_creation_guard.py"
  "startup-refusal|0006|test/admission/test_startup_capacity.py -k refuses_to_start"
  "advertise-limits|0007|test/admission/test_startup_capacity.py -k advertises"
  "http-400|0008|test/admission/test_http_admission.py -k colocated"
  "http-400-pd|0008|test/admission/test_http_admission.py -k pd_refuses and p_lt_d"
  "streaming-4xx|0009|test/admission/test_http_admission.py -k colocated"
  "client-guard|0010|test/admission/test_client_guard.py -k spoofed"
  "decode-limit|0011|test/admission/test_http_admission.py -k pd_refuses"
  "coverage|0012|test/pd/test_divergence.py -k mooncake"
  "peer-release-kv|0013 0014 0015|test/kv/test_kv_transfer.py -k prefill_abort"
  "peer-release|0013 0014 0015 0032|test/pd/test_peer_release.py -k mooncake"
  "peer-release-doors|0014|test/pd/test_peer_release.py -k mooncake and direct"
  "peer-release-http|0015|test/pd/test_peer_release.py -k mooncake and router"
  "liveness-limits|0011|test/pd/test_liveness_limits.py -k every_length and mooncake"
  "pair-agreement|0016 0032|test/pd/test_liveness_limits.py -k mismatched_pair"
  "startup-report|0032|test/pd/test_pd_content.py -k startup_report"
  "peer-refusal-status|0017|test/pd/test_peer_release.py -k refusal_direct"
  "explicit-limits-unit|0007|test/unit/test_admission_explicit_limits.py"
  "peer-release-api-unit|0013|test/unit/test_hook_api.py test/unit/test_peer_release_backends.py"
  "pair-agreement-unit|0016|test/unit/test_pair_agreement.py"
  "room-guard|0018|test/pd/test_room_guard.py -k mooncake"
  "room-guard-unit|0018|test/unit/test_room_guard.py"
  "quarantine-unit|0019|test/unit/test_quarantine.py"
  "late-write|0019|test/pd/test_late_write.py -k fork_keeps"
  "kv-digest-unit|0021|test/unit/test_kv_digest_as_configured.py"
  "kv-digest-e2e|0021|test/pd/test_kv_digest_e2e.py -k mooncake"
  "write-fence-unit|0020|test/unit/test_write_fence.py"
  "peer-capability-unit|0022|test/unit/test_peer_capability.py"
  "source-lease-unit|0023|test/unit/test_source_lease.py"
  "page-generation-unit|0024|test/unit/test_page_generation.py"
  "transfer-generation-unit|0025 0032|test/unit/test_transfer_generation.py"
  "transfer-generation-e2e|0025 0032|test/pd/test_transfer_generation_e2e.py -k mooncake"
  "abort-generation-unit|0026 0032|test/unit/test_abort_generation.py"
  "scheduler-door-unit|0027|test/unit/test_scheduler_door.py"
  "scheduler-door-grpc|0027|test/admission/test_grpc_entry_point.py -k spoofed"
  "operator-release-unit|0028|test/unit/test_operator_api.py"
  "bootstrap-auth-unit|0029|test/unit/test_bootstrap_auth.py"
  "control-mac-unit|0030|test/unit/test_control_mac.py"
  "sample-rooms-unit|0031|test/unit/test_sample_rooms.py"
  "aux-buffers-startup-unit|0033|test/unit/test_aux_buffers_startup.py"
  "mori-generation-unit|0034|test/unit/test_mori_control_messages.py"
  "operator-release|0028|test/pd/test_late_write.py -k operator"
)

want=("$@")
summary="$OUT/summary.tsv"
[ -f "$summary" ] || printf 'row\treverted\ttests\tresult without the patch\tverdict\tfirst failure\n' > "$summary"
for row in "${ROWS[@]}"; do
  IFS='|' read -r name drops tests <<<"$row"
  if [ ${#want[@]} -gt 0 ] && [[ ! " ${want[*]} " == *" $name "* ]]; then continue; fi
  args=()
  for d in $drops; do args+=(-d "$d"); done
  # the -k expression is everything after "-k" (it may contain spaces)
  files=${tests%% -k *}
  kexpr=${tests#* -k }
  [ "$kexpr" = "$tests" ] && kexpr=""
  log="$OUT/$name.log"
  echo "== $name: revert $drops; $tests"
  start=$(date +%s)
  if [ -n "$kexpr" ]; then
    "$VENV/bin/python" scripts/pdsafe-patches ablate "${args[@]}" -- $files -k "$kexpr" \
      "${TIMEOUT[@]}" >"$log" 2>&1
  else
    "$VENV/bin/python" scripts/pdsafe-patches ablate "${args[@]}" -- $files "${TIMEOUT[@]}" \
      >"$log" 2>&1
  fi
  rc=$?
  secs=$(( $(date +%s) - start ))
  result=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)|^=+ .*(passed|failed|error).* in ' "$log" \
           | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
  case $rc in
    0) if [[ $result != *passed* && $result != *failed* ]]; then
         # every test errored in setup (a server that did not start): not the protection's own
         # assertion, so it shows nothing
         verdict="inconclusive (setup errors only, see $log)"
       else
         verdict="shown necessary (tests fail without it)"
       fi;;
    1) verdict="NOT SHOWN: tests pass without it";;
    *) verdict="inconclusive (exit $rc, see $log)";;
  esac
  # the first assertion that failed: evidence that the failure is the protection's, not setup's
  why=$(grep -m1 -E '^E +' "$log" | sed 's/^E *//' | cut -c1-160)
  printf '%s\t%s\t%s\t%s (%ss)\t%s\t%s\n' "$name" "$drops" "$tests" "$result" "$secs" \
    "$verdict" "$why" | tee -a "$summary"
done
