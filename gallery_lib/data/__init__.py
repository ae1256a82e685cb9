"""Datasets and loaders of the gallery: robust class-folder images, caption folders and the device-side loader."""

from gallery_lib.data.captions import CaptionFolder, caption_image_transform
from gallery_lib.data.image_folder import RobustImageDataset, RobustImageFolder, load_rgb
from gallery_lib.data.loader import TrainLoader, build_train_loader, smooth_one_hot

__all__ = ["CaptionFolder", "RobustImageDataset", "RobustImageFolder", "TrainLoader", "build_train_loader",
           "caption_image_transform", "load_rgb", "smooth_one_hot"]
