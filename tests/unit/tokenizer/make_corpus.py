#!/usr/bin/env python3
"""Writes corpus.json (tokenizer tests) and conversations.json (chat template tests).

Deterministic (fixed seed): rerunning it reproduces the committed files. Categories: ASCII
prose, code, long whitespace runs, digits, emoji, CJK, combining marks, mixed scripts,
special tokens inside text, contractions, control characters, the empty string.
"""
import json
import os
import random

rng = random.Random(20261129)
here = os.path.dirname(os.path.abspath(__file__))

PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.",
    "I'm sure they'll say we've done what we'd planned; you're right, isn't it?",
    "HELLO World! How ARE you doing today???",
    "Mr. O'Neil paid $1,234.56 on 2024-03-17 at 10:45pm (EST).",
    "e-mail: someone@example.com, url: https://example.org/path?q=1&r=two#frag",
    "Well... that's it -- or is it?! \"Quoted\" and 'single' quotes.",
]
CODE = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
    "const x = {a: 1, 'b': [2, 3], \"c\": null}; // comment",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "<div class=\"row\"><span>&amp; &lt;tag&gt;</span></div>",
    "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }",
    "    indented\n        more indented\n\ttab\n",
]
EMOJI = ["🙂", "😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "❤️", "🚀", "🤖", "✨", "🍕"]
CJK = ["你好，世界", "東京は日本の首都です。", "안녕하세요 세계", "机器学习模型", "こんにちは、元気ですか？", "中文字符测试"]
COMBINING = ["e\u0301", "a\u0308", "n\u0303", "Cafe\u0301", "A\u030a", "o\u0302\u0323", "\u1100\u1161\u11a8",
             "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d"]
SCRIPTS = ["Привет мир", "Γειά σου Κόσμε", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก",
           "Xin chào thế giới", "Grüße aus Köln", "ça va très bien", "Ñandú", "İstanbul ıı", "ßtraße"]
SPECIALS = ["<s>", "</s>", "<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>",
            "<|start_header_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"]
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from "
         "or one had by word but not what all were we when your can said there use an each which she "
         "do how their if will up other about out many then them these so some her would make like "
         "him into time has look two more write go see number no way could people my than first water").split()

corpus = [""]
corpus += PROSE + CODE
# whitespace runs
for n in [1, 2, 3, 4, 7, 16, 33, 80]:
    corpus.append(" " * n)
    corpus.append("a" + " " * n + "b")
    corpus.append("x\n" + "\n" * (n % 5) + " " * n + "y")
corpus += ["\t\t\tx", "line1\r\nline2\r\n", "trailing   ", "   leading", "\n", "\n\n\n", " \n \n ", "a\u00a0b",
           "tab\tseparated\tvalues", "\u3000full width space"]
# digits
for _ in range(20):
    k = rng.randint(1, 14)
    corpus.append("".join(rng.choice("0123456789") for _ in range(k)))
corpus += ["3.14159", "1,000,000", "v1.2.3", "0x1F", "1e-9", "١٢٣ ٤٥٦", "½ ¾ ²³", "12abc34def5678"]
# emoji, CJK, combining, scripts
for e in EMOJI:
    corpus.append(e)
    corpus.append("I love " + e + " so much" + e + e)
corpus += CJK + COMBINING + SCRIPTS
corpus += [c + " " + s for c, s in zip(CJK, SCRIPTS)]
# specials inside text
for s in SPECIALS:
    corpus.append(s)
    corpus.append("before " + s + " after")
    corpus.append("x" + s + "y" + s)
corpus += ["<s><s></s>", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "< s>", "<|im_start", "<<s>>"]
# contractions and case
corpus += ["I'M", "YOU'RE", "they've", "He'D", "we'LL", "'s", "'tis", "don't", "CAN'T"]
# control characters
corpus += ["a\u0000b", "bell\u0007", "\u001b[31mred\u001b[0m", "zero\u200bwidth", "bom\ufeffx", "\u2028sep"]
# random mixes
pools = [WORDS, EMOJI, CJK, COMBINING, SCRIPTS, SPECIALS, ["\n", "  ", "\t", "123", "4567", ".", ",", "!?", "'s", "--"]]
while len(corpus) < 360:
    parts = []
    for _ in range(rng.randint(1, 18)):
        pool = rng.choices(pools, weights=[10, 1, 1, 1, 2, 1, 3])[0]
        parts.append(rng.choice(pool))
    sep = rng.choice([" ", "", " ", "\n"])
    corpus.append(sep.join(parts))
long_text = " ".join(rng.choice(WORDS) for _ in range(600))
corpus.append(long_text)
corpus.append("".join(rng.choice(CJK) for _ in range(40)))

with open(os.path.join(here, "corpus.json"), "w", encoding="utf-8") as f:
    json.dump(corpus, f, ensure_ascii=False, indent=0)
    f.write("\n")

# Conversations for chat templates.
USER = ["Hello!", "What is 2+2?", "Write a haiku about the sea.", "  spaced question  ", "Translate 'chat' to French.",
        "多语言测试：你好", "Explain recursion\nin two lines.", "Emoji time 🚀✨", "Why?", "List three colours."]
ASSIST = ["Hi there! How can I help?", "4", "Waves fold on the shore\nsalt wind carries gull voices\nthe tide keeps its time",
          "Sure.", "« chat » means cat.", "你好！", "A function that calls itself.\nUntil a base case stops it.",
          "🚀 Launching!", "Because.", "Red, green, blue."]
SYSTEM = ["You are a helpful assistant.", "You are a pirate. Answer like one.", "Be concise."]
convs = []
for i in range(24):
    msgs = []
    if i % 3 != 2:
        msgs.append({"role": "system", "content": rng.choice(SYSTEM)})
    turns = 1 + i % 4
    for t in range(turns):
        msgs.append({"role": "user", "content": rng.choice(USER)})
        if t < turns - 1 or i % 2 == 1:
            msgs.append({"role": "assistant", "content": rng.choice(ASSIST)})
    convs.append({"messages": msgs, "add_generation_prompt": i % 2 == 0})
with open(os.path.join(here, "conversations.json"), "w", encoding="utf-8") as f:
    json.dump(convs, f, ensure_ascii=False, indent=1)
    f.write("\n")
print(len(corpus), "corpus strings,", len(convs), "conversations")
