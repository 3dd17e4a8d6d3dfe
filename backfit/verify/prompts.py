"""Built-in verification text: several languages and code, real text rather than random ids."""

PROMPTS = [
    # English prose
    "The harbour town woke slowly that morning. Fishermen hauled their nets onto the stone quay "
    "while the baker on Mill Street opened his shutters and set out the first loaves of the day. "
    "Children ran past the church with their satchels bouncing, late again for the schoolmaster.",
    # Python
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    "    i = j = 0\n    out = []\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
    "        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    # Chinese
    "深度学习模型的量化是一种在保持精度的同时减少内存占用和计算量的方法。"
    "常见的做法是把权重从十六位浮点数转换为八位整数，并为每一组权重保存一个缩放因子。",
    # German
    "Die Bahn fuhr pünktlich um acht Uhr ab, doch schon nach zwanzig Minuten blieb sie auf freier "
    "Strecke stehen. Der Schaffner entschuldigte sich für die Verspätung und versprach Kaffee.",
    # JSON / config
    '{"model": "deepseek-v4-flash", "tp": 4, "schemes": {"linears": "int8", "experts": "int8"}, '
    '"max_tokens": 1024, "stop": ["<|end|>"], "temperature": 0.6}',
    # Russian
    "Вечером пошёл дождь, и улицы опустели. Только в маленьком кафе на углу ещё горел свет, "
    "и хозяин неторопливо протирал стаканы, слушая старое радио.",
    # Rust
    "fn main() {\n    let v: Vec<u64> = (1..=10).map(|x| x * x).collect();\n"
    "    let total: u64 = v.iter().sum();\n    println!(\"sum of squares = {}\", total);\n}\n",
    # Japanese
    "東京の朝は早い。駅のホームには通勤客があふれ、電車は数分おきに到着する。"
    "それでも人々は静かに列を作り、順番に乗り込んでいく。",
    # French
    "La bibliothèque municipale ouvre ses portes à neuf heures. Les étudiants s'installent près "
    "des fenêtres, tandis que les retraités lisent le journal dans la salle du fond.",
    # SQL
    "SELECT c.name, COUNT(o.id) AS orders, SUM(o.total) AS revenue\nFROM customers c\n"
    "JOIN orders o ON o.customer_id = c.id\nWHERE o.created_at >= '2026-01-01'\n"
    "GROUP BY c.name\nORDER BY revenue DESC\nLIMIT 20;",
]
