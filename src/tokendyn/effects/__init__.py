"""What an update does to each token: the model-based analyses of a batch, made from one parameter state and undone.

The recorder (`tokendyn.probe`) reads what the training backward itself shows; this room makes the updates the
training did not make, or makes them again, and measures what they do to every token's probability:

* ``shares``: the per-bin gradients g_b and their shares of the update, s_b = <g_b, g> / ||g||^2 (per token s_t by
  one forward-mode JVP);
* ``change``: Delta pi after the counterfactual SGD step (the paper's diagnostic) or the real one, correct ratios, and
  ``limit``: dpi/dlr at lr -> 0 (one JVP), the limit the paper's theory describes;
* ``influence``: the influence matrix, one counterfactual step per source bin;
* ``compare``: the paired comparison of update rules from the same state (both camps, K inner updates), and ``axis``:
  the c and eta sweeps through them;
* ``resolution``: how finely a counterfactual step was resolved, and which steps carry no update at all; and
  ``precision``: whether the model's dtype gives the float64 numbers, measured on the run's own steps;
* ``rebalance``: all of them on one batch (``analyze_update``), what the hooks call; ``token_view``: every token's
  numbers for the page.

Arrows: hooks / integrations -> effects -> probe (the objective and its rules, the forward, the bins) -> records.
"""
