# ruff: noqa: E501 - a template line reads best whole
r"""Chat templates written here after the rules of real model families (Qwen3, Qwen2.5, Llama 3.x).

Each is Jinja in the Hugging Face convention (``messages``, ``tools``, ``add_generation_prompt``,
``bos_token``, ``strftime_now``), written from the families' published rules (the comments above
each), not copied. :mod:`agentrl.standin` saves them into stand-in model directories, and the
chat-template tests check append-only tokenisation against them.
"""

from __future__ import annotations

# ---------------------------------------------------------------------------- Qwen3
# Rules of Qwen3's template:
# 1. With ``tools``, the first turn is a system turn: the system message (if any), then a
#    "# Tools" section listing each tool as JSON inside <tools></tools> and the call format.
#    Without tools, a leading system message is rendered as a plain system turn.
# 2. Every message is "<|im_start|>ROLE\n" + content + "<|im_end|>\n".
# 3. The last *query* is the last user message that is not a wrapped tool response
#    ("<tool_response>...</tool_response>"); tool rounds after it belong to the same query.
# 4. An assistant message's reasoning is its ``reasoning_content`` or, when its content has
#    "</think>", the text between "<think>" and "</think>" (the content keeps what follows,
#    with leading newlines stripped).
# 5. An assistant turn after the last query is rendered with "<think>\n" + reasoning +
#    "\n</think>\n\n" + content when it is the last message or has reasoning; every earlier
#    assistant turn is rendered without its think block (the template rewrites history).
# 6. Structured ``tool_calls`` follow the content as "<tool_call>\n{json}\n</tool_call>".
# 7. Tool messages are rendered inside a *user* turn, each as
#    "\n<tool_response>\n" + content + "\n</tool_response>"; consecutive tool messages share
#    one user turn (opened by the first, closed by the last).
# 8. The generation prompt is "<|im_start|>assistant\n"; with ``enable_thinking=false`` it
#    also carries an empty think block "<think>\n\n</think>\n\n" (the model answers at once).
QWEN3 = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(query=true, last_query=messages | length - 1) %}
{%- for m in messages[::-1] %}
{%- set i = messages | length - 1 - loop.index0 %}
{%- if ns.query and m.role == 'user' and not (m.content.startswith('<tool_response>')
      and m.content.endswith('</tool_response>')) %}
{%- set ns.query = false %}{%- set ns.last_query = i %}
{%- endif %}
{%- endfor %}
{%- for m in messages %}
{%- set content = m.content if m.content is string else '' %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{%- set reasoning = '' %}
{%- if m.reasoning_content is string %}{%- set reasoning = m.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n'
    + content.lstrip('\n') }}
{%- else %}
{{- '<|im_start|>assistant\n' + content }}
{%- endif %}
{%- for call in m.tool_calls or [] %}
{%- set call = call.function or call %}
{%- if content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson)
    + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

# ---------------------------------------------------------------------------- Qwen2.5
# Rules of Qwen2.5's template:
# 1. Without a leading system message, a default one is rendered ("You are Qwen, created by
#    Alibaba Cloud. You are a helpful assistant."); with ``tools`` the system turn also lists
#    them in <tools></tools> with the call format.
# 2. Messages are ChatML turns; no thinking, contents are rendered as they are.
# 3. Tool messages go in a user turn as "\n<tool_response>\n...\n</tool_response>",
#    consecutive ones merged into one turn.
# 4. The generation prompt is "<|im_start|>assistant\n".
QWEN2_5 = r"""
{%- set default = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}
{%- set system = messages[0].content if messages[0].role == 'system' else default %}
{%- if tools %}
{{- '<|im_start|>system\n' + system + '\n\n# Tools\n\nYou may call one or more functions to ' }}
{{- 'assist with the user query.\n\nYou are provided with function signatures within ' }}
{{- '<tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>system\n' + system + '<|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) or m.role == 'assistant' %}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{%- if messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# ---------------------------------------------------------------------------- Llama 3.x
# Rules of Llama 3.1-3.3's template:
# 1. The text starts with ``bos_token`` (<|begin_of_text|>), rendered by the template itself.
# 2. A system turn is always rendered, with or without a system message: a header
#    "<|start_header_id|>system<|end_header_id|>\n\n", "Environment: ipython\n" when tools are
#    given, the date lines "Cutting Knowledge Date: December 2023\nToday Date: " + date + "\n\n"
#    (``date_string``, else today's date from ``strftime_now``), then the system message.
# 3. Every message is "<|start_header_id|>" + role + "<|end_header_id|>\n\n" + content | trim +
#    "<|eot_id|>"; a tool message's role is rendered as "ipython".
# 4. With tools, they are listed as JSON in the first user message.
# 5. The generation prompt is "<|start_header_id|>assistant<|end_header_id|>\n\n".
LLAMA3 = r"""
{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}
{%- if messages[0].role == 'system' %}
{%- set system = messages[0].content | trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}{{- 'Environment: ipython\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + date_string + '\n\n' }}
{{- system + '<|eot_id|>' }}
{%- for m in messages %}
{%- set role = 'ipython' if m.role == 'tool' else m.role %}
{{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' }}
{%- if tools and loop.first and m.role == 'user' %}
{{- 'Given the following functions, please respond with a JSON for a function call with its '
    'proper arguments that best answers the given prompt.\n\n' }}
{%- for tool in tools %}{{- (tool | tojson(indent=4)) + '\n\n' }}{%- endfor %}
{%- endif %}
{{- (m.content | trim) + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""
