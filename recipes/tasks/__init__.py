"""Task registry: which LightningModule trains each of the paper's four tasks."""

from __future__ import annotations

from recipes.tasks.base import ClassificationTask, LanguageModelTask, RecipeTask
from recipes.tasks.seq2seq import Seq2SeqTask

TASKS: dict[str, type[RecipeTask]] = {
    "image": ClassificationTask,
    "translation": Seq2SeqTask,
    "language_model": LanguageModelTask,
    "video_captioning": Seq2SeqTask,
}
