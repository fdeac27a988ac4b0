"""MiniMax-M3's output markers, as its chat template writes them and the model emits them.

A reply may open with a reasoning block, then text, then one block of tool calls::

    <mm:think>REASONING</mm:think>TEXT]<]minimax[>[<tool_call>
    ]<]minimax[>[<invoke name="get_weather">]<]minimax[>[<city>Paris]<]minimax[>[</city>]<]minimax[>[</invoke>
    ]<]minimax[>[</tool_call>

Every tool-call element carries the namespace token in front.  Each argument is an element named after it; an object
value nests one element per key, an array value one ``<item>`` element per entry, and a scalar is its text (booleans
as ``true``/``false``).  Sources: the checkpoint's chat template (its ``to_xml`` macro) and the reference stacks'
``minimax_m3`` tool-call and reasoning parsers.
"""

NAMESPACE = "]<]minimax[>["
CALLS_OPEN = NAMESPACE + "<tool_call>"
CALLS_CLOSE = NAMESPACE + "</tool_call>"
INVOKE_OPEN = NAMESPACE + '<invoke name="'
INVOKE_NAME_END = '">'
INVOKE_CLOSE = NAMESPACE + "</invoke>"
ELEMENT_OPEN = NAMESPACE + "<"
ELEMENT_CLOSE = NAMESPACE + "</"
ARRAY_ITEM = "item"
THINK_OPEN = "<mm:think>"
THINK_CLOSE = "</mm:think>"

# Tokens of M3's vocabulary the output parser reads (reasoning; tool calls): decoding keeps them even where other
# special tokens are skipped (``skip_special_tokens``).
CALL_MARKERS = (NAMESPACE, "<tool_call>", "</tool_call>")
MARKER_TOKENS = (THINK_OPEN, THINK_CLOSE, *CALL_MARKERS)


def element_open(name: str) -> str:
    return f"{ELEMENT_OPEN}{name}>"


def element_close(name: str) -> str:
    return f"{ELEMENT_CLOSE}{name}>"
