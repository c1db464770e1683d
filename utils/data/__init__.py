"""Data layer of the RLHF pipeline (DeepSpeed-Chat's data contract).

Three steps share the same sources: step 1 (SFT) trains on prompt+chosen,
step 2 (reward model) on prompt+chosen+rejected pairs, step 3 (PPO) on
prompts only.  Like DeepSpeed-Chat, every source's train rows are cut into
three disjoint parts by ``--data_split`` so that no step sees another step's
training rows, while the eval split is shared.

The package has layers, each usable on its own (imports go one way,
``sources`` <- ``rows`` <- ``tokenize`` <- ``collate``):

* ``sources``: reading sources (``load_source``) into raw records with an
  ``origin`` ("path:line") so that every error can point at the offending line;
* ``rows``: selecting and normalising the rows of one step
  (``build_step_rows``), or of one source's eval split (``read_rows``);
* ``tokenize``: tokenising rows (``tokenize_sft``/``tokenize_pairs``/
  ``tokenize_prompts``) and plain texts (``read_texts``/``tokenize_texts``);
* ``collate``: padding batches (``SFTCollator``/``PairCollator``/
  ``PromptCollator``) and the distributed loader (``distributed_loader``).

Nothing is dropped silently: skipped or truncated rows are counted in the
returned stats and summarised through ``log``.
"""

from utils.data.sources import EVAL_SPLIT_NAMES, JSON_EXTS, DataError, Source, load_source
from utils.data.rows import (STEP_FIELDS, STEP_NAMES, StepRows, build_step_rows, eval_size, normalize_row,
                             parse_data_split, read_rows, split_bounds, split_source)
from utils.data.tokenize import (IGNORE_INDEX, bos_prefix, encode, fit_prompt, fit_tail, read_texts, tokenize_pairs,
                                 tokenize_prompts, tokenize_sft, tokenize_texts)
from utils.data.collate import PairCollator, PromptCollator, SFTCollator, distributed_loader, pad_batch

__all__ = [
    "EVAL_SPLIT_NAMES", "JSON_EXTS", "DataError", "Source", "load_source",
    "STEP_FIELDS", "STEP_NAMES", "StepRows", "build_step_rows", "eval_size", "normalize_row", "parse_data_split",
    "read_rows", "split_bounds", "split_source",
    "IGNORE_INDEX", "bos_prefix", "encode", "fit_prompt", "fit_tail", "read_texts", "tokenize_pairs",
    "tokenize_prompts", "tokenize_sft", "tokenize_texts",
    "PairCollator", "PromptCollator", "SFTCollator", "distributed_loader", "pad_batch",
]
