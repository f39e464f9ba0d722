# scripts/headline.sh: one row of the README's headline table from a
# headline-*.json (sim --slo --json): each policy's capacity_rps, and e2
# against the best other policy and round-robin (ties within the search's 5%).
def fmt: if . == 0 then "0" elif . >= 10 then (. * 10 | round / 10 | tostring) else (. * 100 | round / 100 | tostring) end;
[.results | group_by(.policy)[] | {key: .[0].policy, value: .[0].capacity_rps}] | from_entries as $c
| ["round-robin","least-load","prefix","llmd-precise","sglang","e2"] as $ps
| ([$ps[] | select(. != "e2") | {p: ., c: $c[.]}] | max_by(.c)) as $best
| $c["e2"] as $e
| (if $e == 0 and $best.c == 0 then "none meets it"
   elif $best.c * 1.05 < $e then "**wins**, \($e / $best.c * 100 | round / 100)× \($best.p)"
   elif $e * 1.05 < $best.c then "**loses**: \($best.p) \($best.c / $e * 100 | round / 100)× e2"
   else "tie with \($best.p) (within 5%)" end) as $verdict
| (if $c["round-robin"] > 0 then "\($e / $c["round-robin"] * 100 | round / 100)×" else "—" end) as $rr
| ([$ps[] | $c[.] | fmt] | join(" | ")) + " | " + $verdict + " | " + $rr
