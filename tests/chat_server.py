"""What the server tests share: the tiny chat model's template, the API key, requests and schemas.
Their fixtures (the model, the `colibri serve` process, an openai client, transformers' side) are in
conftest.py."""

from __future__ import annotations

KEY = "sk-test-colibri"
# GLM-style: the template writes the next turn's marker, and <|user|> (one token in the tiny
# vocabulary) is then the template's stop token.



TEMPLATE = ("{{ bos_token }}{% if tools %}<|system|>\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
            "{% endif %}"
            "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{% elif m['role'] in ('system', 'tool') %}"
            "<|system|>{% else %}<|assistant|>{% endif %}\n{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}"
            "<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")



MESSAGES = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Once upon a time"}]



AUTH = {"Authorization": f"Bearer {KEY}"}



CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}



WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}



CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}



PICK = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["color", "n"], "additionalProperties": False}
