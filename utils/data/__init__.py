"""Data layer of the RLHF pipeline (DeepSpeed-Chat's data contract).

Three steps share the same sources: step 1 (SFT) trains on prompt+chosen,
step 2 (reward model) on prompt+chosen+rejected pairs, step 3 (PPO) on
prompts only.  Like DeepSpeed-Chat, every source's train rows are cut into
three disjoint parts by ``--data_split`` so that no step sees another step's
training rows, while the eval split is shared.

The package has layers, each usable on its own (imports go one way,
``sources`` <- ``formats`` <- ``rows``; ``formats`` <- ``chat`` <- ``tokenize`` <- ``collate``;
``cache`` stands beside them, needing only ``DataError``):

* ``sources``: reading sources (``load_source``) into raw records with an
  ``origin`` ("path:line") so that every error can point at the offending line;
* ``formats``: every accepted row layout -> one normalised row (``normalize_row``);
* ``chat``: chat templates, rendered to the template's own token ids;
* ``rows``: selecting and normalising the rows of one step
  (``build_step_rows``), or of one source's eval split (``read_rows``);
* ``tokenize``: tokenising rows (``tokenize_sft``/``tokenize_pairs``/
  ``tokenize_preference_pairs``/``tokenize_unpaired``/``tokenize_prompts``) and plain texts
  (``read_texts``/``tokenize_texts``);
* ``collate``: padding batches (``SFTCollator``/``PairCollator``/
  ``PreferenceCollator``/``UnpairedCollator``/``PromptCollator``) and the distributed loader (``distributed_loader``);
* ``cache``: tokenised examples kept on disk for later runs and the other
  ranks (``cached_examples``, ``--data_output_path``).

Nothing is dropped silently: skipped or truncated rows are counted in the
returned stats and summarised through ``log``.
"""

from utils.data.chat import load_chat_template, require_template, stop_token_ids
from utils.data.collate import (
    PairCollator,
    PreferenceCollator,
    PromptCollator,
    SFTCollator,
    UnpairedCollator,
    distributed_loader,
    pad_batch,
    response_rows,
    split_pair_batch,
)
from utils.data.formats import DEFAULT_FORMAT, RowFormat, SkipRow, is_chat, normalize_row, prompt_text
from utils.data.sources import EVAL_SPLIT_NAMES, JSON_EXTS, DataError, Source, load_source, source_fingerprint
from utils.data.splits import (
    STEP_NAMES,
    StepRows,
    build_step_rows,
    describe_skips,
    eval_size,
    parse_data_split,
    read_rows,
    split_bounds,
    split_source,
)
from utils.data.token_cache import cached_examples
from utils.data.tokenize import (
    IGNORE_INDEX,
    bos_prefix,
    check_not_all_too_long,
    encode,
    fit_prompt,
    fit_tail,
    prompt_parts,
    read_texts,
    scored_sequences,
    tokenize_pairs,
    tokenize_preference_pairs,
    tokenize_prompts,
    tokenize_sft,
    tokenize_texts,
    tokenize_unpaired,
    tokenizer_fingerprint,
)

__all__ = [
    "EVAL_SPLIT_NAMES",
    "JSON_EXTS",
    "DataError",
    "Source",
    "load_source",
    "source_fingerprint",
    "cached_examples",
    "tokenizer_fingerprint",
    "DEFAULT_FORMAT",
    "RowFormat",
    "SkipRow",
    "is_chat",
    "normalize_row",
    "prompt_text",
    "STEP_NAMES",
    "StepRows",
    "build_step_rows",
    "describe_skips",
    "check_not_all_too_long",
    "eval_size",
    "parse_data_split",
    "read_rows",
    "split_bounds",
    "split_source",
    "load_chat_template",
    "require_template",
    "stop_token_ids",
    "IGNORE_INDEX",
    "bos_prefix",
    "encode",
    "fit_prompt",
    "fit_tail",
    "prompt_parts",
    "read_texts",
    "scored_sequences",
    "tokenize_pairs",
    "tokenize_preference_pairs",
    "tokenize_prompts",
    "tokenize_sft",
    "tokenize_texts",
    "tokenize_unpaired",
    "PairCollator",
    "PreferenceCollator",
    "PromptCollator",
    "SFTCollator",
    "UnpairedCollator",
    "distributed_loader",
    "pad_batch",
    "response_rows",
    "split_pair_batch",
]
