"""The DeepSeek-V4 chat template's constant text (dsv4-model.md §7, the official
`encoding/encoding_dsv4.py`): control tokens, the reasoning-effort prompts per encoder profile
and the client levels mapped onto them, the tools block and the response-format header. The
encoding itself is `chat_format`'s."""

from __future__ import annotations

__all__ = [
    "BOS", "EOS", "USER", "ASSISTANT", "LATEST_REMINDER", "THINK_START", "THINK_END", "DSML",
    "CONTROL_TOKENS", "REQUIRED_TOKENS", "EFFORT_PROMPTS", "CLIENT_EFFORT", "TOOLS_HEAD",
    "TOOLS_TAIL", "RESPONSE_FORMAT",
]

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, LATEST_REMINDER = "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"
THINK_START, THINK_END, DSML = "<think>", "</think>", "｜DSML｜"
CONTROL_TOKENS = (BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, THINK_START, THINK_END, DSML)
REQUIRED_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END)

_ABS_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n")
_BEYOND_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
    "exhaustively decompose the problem into its most fundamental components, trace every causal "
    "chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple "
    "angles and are certain that no assumption remains unchecked and no error remains "
    "undiscovered.\n\n")
# profile -> encoder level -> text prepended at index 0 in thinking mode (None: encoder default)
EFFORT_PROMPTS = {
    "flash": {None: "", "high": "", "max": _ABS_MAX},
    "0731": {None: "", "low": "", "high": _ABS_MAX, "max": _BEYOND_MAX},
}
CLIENT_EFFORT = {  # client level -> encoder level, per profile
    "flash": {"minimal": "high", "low": "high", "medium": "high", "high": "high",
              "xhigh": "max", "max": "max"},
    "0731": {"minimal": "low", "low": "low", "medium": "high", "high": "high",
             "xhigh": "max", "max": "max"},
}

# the model's prompt, verbatim from the reference TOOLS_TEMPLATE (up to {tool_schemas})
TOOLS_HEAD = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can "
    'invoke tools by writing a "<{d}tool_calls>" block like the following:\n\n<{d}tool_calls>\n'
    '<{d}invoke name="$TOOL_NAME">\n<{d}parameter name="$PARAMETER_NAME" string="true|false">'
    "$PARAMETER_VALUE</{d}parameter>\n...\n</{d}invoke>\n<{d}invoke name=\"$TOOL_NAME2\">\n"
    "...\n</{d}invoke>\n</{d}tool_calls>\n\nString parameters should be specified as is and "
    'set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the '
    'value in JSON format and set `string="false"`.\n\nIf thinking_mode is enabled (triggered '
    "by {s}), you MUST output your complete reasoning inside {s}...{e} BEFORE any tool calls or "
    "final response.\n\nOtherwise, output directly after {e} with tool calls or final "
    "response.\n\n### Available Tool Schemas\n\n").format(d=DSML, s=THINK_START, e=THINK_END)
TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to " \
              "invoke tool calls.\n"
RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema " \
                   "to reply:\n"
