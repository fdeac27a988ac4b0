"""The tiny default model's tokenizer: byte-level BPE (any UTF-8 text round-trips) plus M3's special tokens.

M3's real tokenizer is a 200K byte-level BPE whose special tokens sit at ids 200000..200060.  The tiny one keeps
the same special-token strings (so chat templates, placeholder expansion and stop tokens work unchanged) after a
small vocabulary trained on a fixed text, so every machine builds the same ids.
"""

from importlib import resources

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

BOS_TOKEN = "]~!b["
EOS_TOKEN = "[e~["  # also the end of every chat turn
IMAGE_TOKEN = "]<]image[>["
VIDEO_TOKEN = "]<]video[>["
IMAGE_START_TOKEN = "]<]start of image[>["
IMAGE_END_TOKEN = "]<]end of image[>["
VIDEO_START_TOKEN = "]<]start of video[>["
VIDEO_END_TOKEN = "]<]end of video[>["

# M3's special tokens in id order (200000 + position in the real tokenizer).
SPECIAL_TOKENS = (
    "]!p~[",
    "<fim_prefix>",
    "<fim_middle>",
    "<fim_suffix>",
    "<fim_pad>",
    "<reponame>",
    "<filename>",
    "<gh_stars>",
    "<issue_start>",
    "<issue_comment>",
    "<issue_closed>",
    "<jupyter_start>",
    "<jupyter_text>",
    "<jupyter_code>",
    "<jupyter_output>",
    "<empty_output>",
    "<commit_before>",
    "<commit_msg>",
    "<commit_after>",
    "]~b]",
    EOS_TOKEN,
    "]!d~[",
    "<function_call>",
    "<code_interpreter>",
    "]<]speech[>[",
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    "]<]start of speech[>[",
    "]<]end of speech[>[",
    IMAGE_START_TOKEN,
    IMAGE_END_TOKEN,
    VIDEO_START_TOKEN,
    VIDEO_END_TOKEN,
    "]<]vision pad[>[",
    BOS_TOKEN,
    "<jupyter_error>",
    "<add_file>",
    "<delete_file>",
    "<rename_file>",
    "<edit_file>",
    "<commit_message>",
    "<empty_source_file>",
    "<repo_struct>",
    "<code_context>",
    "<file_content>",
    "<source_files>",
    "<pr_start>",
    "<review_comment>",
    "<filepath>",
    "<file_sep>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "]<]frame[>[",
    "]<]start of frame[>[",
    "]<]end of frame[>[",
    "<|content_altered_placeholder|>",
    "]<]minimax[>[",
    "<mm:think>",
    "</mm:think>",
)

# Byte alphabet (256) + at most this many minus 256 merges learned from the training text (it yields fewer);
# special tokens come after.
BPE_VOCAB_SIZE = 451

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words, and a video holds many pictures.
You are a helpful assistant. Describe the image in one sentence. What is in this video? Summarize the text below.
The model reads the prompt, looks at the images and the frames of the video, and then writes an answer token by token.
Serving a large language model means batching requests, caching keys and values, and streaming tokens to the user.
Sparse attention selects the blocks of the context that matter most for each query, so long prompts stay fast.
def main(): print("hello, world") for i in range(10): total = total + i * 2 return {"status": "ok", "count": 42}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 16 32 64 100 128 256 512 1024 2048 4096. Dates like 2026-11-30 and times 12:45.
Questions and answers: Who are you? I am a small test model with random weights, so my answers are random words.
Kubernetes runs the gateway and the engine pods; the operator watches the deployment and scales it with the load.
"""


def build_tiny_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    return tokenizer


def chat_template() -> str:
    """M3's prompt layout (system and developer turns, tools, tool calls, tool results, thinking modes), as its own
    template renders it; images and videos as one placeholder each."""
    return resources.files(__package__).joinpath("chat_template.jinja").read_text()
