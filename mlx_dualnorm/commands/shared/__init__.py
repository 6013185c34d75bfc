"""What several commands share: the parser and argument types, the compared
paths, the synthetic mlx-lm models. Importing this package imports none of them."""
