"""Dense: full attention over every cached token (the accuracy and speed baseline)."""

from sparsetune.flow import DecodeFlow


class Dense(DecodeFlow):
    name = "dense"
    source = "full attention"
    full_attention = True
