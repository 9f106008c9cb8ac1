"""Data and randomness keyed by position (``keyed``) and the example's offline corpus (``corpus``)."""
