"""Image data: scikit-learn's bundled digits (offline default) and an ImageNet-layout ImageFolder from a path."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import TensorDataset

from recipes.data.common import RecipeDataModule, require_dir, seeded_permutation

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class DigitsDataModule(RecipeDataModule):
    """scikit-learn's 1,797 8x8 digits (bundled with the package, nothing downloaded), split train/val."""

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.2, **kwargs: Any) -> None:
        super().__init__(batch_size, **kwargs)
        self.val_fraction = val_fraction

    def load(self) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        x = (x - 0.3) / 0.4  # roughly zero mean, unit variance over the data set
        y = torch.tensor(digits.target, dtype=torch.long)
        order = torch.tensor(seeded_permutation(len(y), self.seed))
        n_val = int(len(y) * self.val_fraction)
        self.val_set = TensorDataset(x[order[:n_val]], y[order[:n_val]])
        self.train_set = TensorDataset(x[order[n_val:]], y[order[n_val:]])

    def model_kwargs(self) -> dict[str, Any]:
        return {"num_classes": 10, "in_channels": 1, "image_size": 8}


class ImageFolderDataModule(RecipeDataModule):
    """ImageNet layout: <path>/train/<class>/*.JPEG and <path>/val/<class>/*.JPEG, read by torchvision's ImageFolder."""

    def __init__(self, path: str | None = None, batch_size: int = 64, image_size: int = 224, train_dir: str = "train",
                 val_dir: str = "val", **kwargs: Any) -> None:
        super().__init__(batch_size, **kwargs)
        self.path = path
        self.image_size = image_size
        self.train_dir, self.val_dir = train_dir, val_dir
        self.num_classes: int | None = None

    def load(self) -> None:
        from torchvision import datasets, transforms

        expected = f"an ImageNet-layout folder with {self.train_dir}/<class>/*.JPEG and {self.val_dir}/<class>/*.JPEG"
        root = require_dir(self.path, "the image folder", expected)
        for split in (self.train_dir, self.val_dir):
            if not (root / split).is_dir():
                raise FileNotFoundError(f"{root / split} is missing: data.path must hold {expected}")
        normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
        size = self.image_size
        train_tf = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                                       transforms.ToTensor(), normalize])
        # ImageNet's usual 256 -> 224 evaluation crop, scaled to the configured size
        val_tf = transforms.Compose([transforms.Resize(int(size * 256 / 224)), transforms.CenterCrop(size),
                                     transforms.ToTensor(), normalize])
        self.train_set = datasets.ImageFolder(str(root / self.train_dir), transform=train_tf)
        self.val_set = datasets.ImageFolder(str(root / self.val_dir), transform=val_tf)
        if self.train_set.classes != self.val_set.classes:
            raise ValueError(f"{root}: the class folders of {self.train_dir}/ and {self.val_dir}/ differ; "
                             "both splits need the same class folders")
        self.num_classes = len(self.train_set.classes)

    def model_kwargs(self) -> dict[str, Any]:
        self.setup()
        return {"num_classes": self.num_classes, "in_channels": 3, "image_size": self.image_size}
