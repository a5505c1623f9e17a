"""Rollouts: completions sampled from the policy being trained, scored by the rewards users
write, and turned into the rows an online objective (`objective=grpo`) trains on.

It sits under the run (the trainer asks for a rollout batch each time one is due, handing it the
strategy's current weights) and above everything a rollout reads: the model layer (the policy's
Hugging Face model, its tokenizer), the data layer (the prompts' records) and the objective."""
