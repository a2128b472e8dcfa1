"""The experiment trackers under the component paths configs name (``metric_logger._component_:
torchtune_ac.training.metric_logging.WandBLogger``); they live in ``torchtune_ac.observability``."""

from torchtune_ac.observability.metric_logging import TensorBoardLogger, WandBLogger

__all__ = ["TensorBoardLogger", "WandBLogger"]
