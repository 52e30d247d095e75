"""vramplan inside the training libraries people already use: Hugging Face's Trainer
(``integrations.transformers``), Lightning (``integrations.lightning``) and accelerate
(``integrations.accelerate``). Each module imports its library only when it is used."""
