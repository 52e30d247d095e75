"""Colours of the components: the Okabe–Ito palette, distinguishable with colour-blindness;
every chart also labels its parts in words.

>>> COLOURS["activations"]
'#D55E00'
"""

COLOURS = {
    "parameters": "#0072B2",
    "buffers": "#56B4E9",
    "gradients": "#009E73",
    "optimizer_state": "#E69F00",
    "activations": "#D55E00",
    "temporaries": "#CC79A7",
    "inputs": "#F0E442",
}
LABELS = {
    "parameters": "parameters",
    "buffers": "buffers",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "temporaries": "temporaries / workspace",
    "inputs": "input batch",
}
