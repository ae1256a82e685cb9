"""Datasets and loaders of the gallery: robust class-folder images and the device-side training loader."""

from gallery_lib.data.image_folder import RobustImageFolder, load_rgb
from gallery_lib.data.loader import TrainLoader, build_train_loader, smooth_one_hot

__all__ = ["RobustImageFolder", "TrainLoader", "build_train_loader", "load_rgb", "smooth_one_hot"]
