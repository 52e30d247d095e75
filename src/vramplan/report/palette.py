"""Colours of the components: the Okabe–Ito palette, distinguishable with colour-blindness;
every chart also labels its parts in words.

>>> COLOURS[Component.ACTIVATIONS]
'#D55E00'
"""

from vramplan.result import Component

COLOURS = {
    Component.PARAMETERS: "#0072B2",
    Component.BUFFERS: "#56B4E9",
    Component.GRADIENTS: "#009E73",
    Component.OPTIMIZER_STATE: "#E69F00",
    Component.ACTIVATIONS: "#D55E00",
    Component.TEMPORARIES: "#CC79A7",
    Component.INPUTS: "#F0E442",
    Component.KV_CACHE: "#999999",
}
LABELS = {
    Component.PARAMETERS: "parameters",
    Component.BUFFERS: "buffers",
    Component.GRADIENTS: "gradients",
    Component.OPTIMIZER_STATE: "optimizer state",
    Component.ACTIVATIONS: "activations",
    Component.TEMPORARIES: "temporaries / workspace",
    Component.INPUTS: "input batch",
    Component.KV_CACHE: "KV cache",
}
