//! P's side of the engine process: its scheduler, its simulated GPU computing prompts in
//! chunks (or, with a model, the model computing them chunk by chunk on the payload threads),
//! and the exports of what it computed.

use super::*;

/// P's side: its simulated GPU.
pub(super) struct PrefillSide {
    /// Simulated compute per prompt token.
    per_token: Duration,
    /// When the GPU is done with the prompts it was given.
    gpu_free: Instant,
    /// Prompts on the GPU or being filled, not yet exported, in the GPU's order.
    prompts: Vec<Prompt>,
    /// Tokens per chunk of the simulated compute, each reported as it ends (`None`: no chunks).
    chunk: Option<u64>,
    /// With a model: each layer of a chunk is reported as the model stores it.
    by_layer: bool,
    /// Push mode: the ranks' commands go before the router hears of an export.
    push: bool,
}

impl PrefillSide {
    /// The tokens of `prompt` computed by `now`, in whole chunks (all of them once it is due).
    fn chunked_tokens(&self, prompt: &Prompt, now: Instant) -> u64 {
        let Some(chunk) = self.chunk else { return 0 };
        let per_token = self.per_token.as_nanos().max(1);
        let tokens = (now.saturating_duration_since(prompt.start).as_nanos() / per_token) as u64;
        (tokens / chunk * chunk).min(prompt.prompt_tokens)
    }

    /// When the next chunk of `prompt` ends (its compute's end at the latest).
    fn next_chunk(&self, prompt: &Prompt, now: Instant) -> Instant {
        let Some(chunk) = self.chunk else { return prompt.due };
        let next = self.chunked_tokens(prompt, now) + chunk;
        let at = prompt.start + self.per_token.saturating_mul(u32::try_from(next).unwrap_or(u32::MAX));
        at.min(prompt.due)
    }
}

impl Side for PrefillSide {
    type Worker = PrefillWorker;
    type Scheduler = PrefillScheduler;
    const ROLE: Role = Role::Prefill;

    fn new(config: &NodeConfig, offer: &Handshake, addresses: Vec<PeerAddress>) -> Result<(Self, PrefillScheduler)> {
        let scheduler = PrefillScheduler::new(offer, addresses, config.connector())?;
        let per_token = Duration::from_micros(config.prefill_us_per_token);
        // A model computes for real, in chunks whether or not compute is simulated.
        let computes = !per_token.is_zero() || config.engine_model.is_some();
        let chunk = (config.prefill_chunk_tokens > 0 && computes).then_some(config.prefill_chunk_tokens);
        let by_layer = config.engine_model.is_some_and(|m| m.layer_progress);
        let push = config.push;
        let side = PrefillSide { per_token, gpu_free: Instant::now(), prompts: Vec::new(), chunk, by_layer, push };
        Ok((side, scheduler))
    }

    fn worker(config: &NodeConfig, offer: &Handshake, pool: LocalPool) -> Result<PrefillWorker> {
        Ok(PrefillWorker::new(offer.clone(), config.connector(), pool)?)
    }

    fn writes_ahead(command: &PrefillCommand) -> WritesAhead {
        match command {
            PrefillCommand::Progress { request, blocks, .. } => {
                WritesAhead::Computed(request.as_str().to_owned(), blocks.clone())
            }
            PrefillCommand::Export { request, .. } | PrefillCommand::Abandon { request } => {
                WritesAhead::Ended(request.as_str().to_owned())
            }
        }
    }

    fn settle(node: &mut Node<Self>) -> Result<()> {
        let now = Instant::now();
        let mut i = 0;
        while i < node.side.prompts.len() {
            let prompt = &node.side.prompts[i];
            if prompt.due <= now && prompt.is_filled() {
                let prompt = node.side.prompts.remove(i);
                node.computed(prompt)?;
            } else {
                i += 1;
            }
        }
        node.progress(now)?;
        node.drain()
    }

    fn next_due(&self) -> Option<Instant> {
        let now = Instant::now();
        // One computed but not yet filled waits for its filling, which wakes the loop.
        let waiting = self.prompts.iter().filter(|p| p.due > now || p.is_filled());
        waiting.map(|p| self.next_chunk(p, now)).min()
    }

    fn handle(node: &mut Node<Self>, command: Command) -> Result<()> {
        match command {
            Command::Prefill { id, prompt_tokens, n, consumer, prompt_ids } => {
                let consumer = consumer.map(|(engine, instance)| Consumer { engine: EngineId::new(engine), instance });
                node.prefill(id, prompt_tokens, n, consumer, prompt_ids)?;
            }
            other => node.engine.emit(&Event::Error { message: format!("a prefill engine cannot {other:?}") }),
        }
        Ok(())
    }

    fn handle_done(node: &mut Node<Self>, done: Done<Tag>) -> Result<()> {
        let Done { tag, model, .. } = done;
        match tag {
            Tag::Filled { id, part } => {
                let prompt = node.side.prompts.iter_mut().find(|p| p.id == id);
                let prompt = prompt.filter(|p| part < p.filled.len());
                let prompt = prompt.ok_or_else(|| anyhow!("filled part {part} of {id}, which P does not compute"))?;
                prompt.filled[part] = true;
                if let Some(ModelOut::First(first)) = model {
                    prompt.first = Some(first);
                }
                // A model's chunks compute one after another: each reads the KV of those before.
                if prompt.model.is_some() && part + 1 < prompt.filled.len() {
                    let work = node.compute_part(&id, part + 1, Vec::new())?;
                    node.engine.payload.submit(Tag::Filled { id, part: part + 1 }, work);
                }
                Ok(())
            }
            _ => Err(anyhow!("a prefill engine handed over work it does not do")),
        }
    }
}

impl Node<PrefillSide> {
    /// Starts a prompt: allocates its blocks and hands their filling (or, with a model, its
    /// first chunk's compute) to the payload threads; [`Node::computed`] exports them.
    fn prefill(
        &mut self,
        id: String,
        prompt_tokens: u64,
        n: u32,
        consumer: Option<Consumer>,
        prompt_ids: Option<Vec<u32>>,
    ) -> Result<()> {
        let count = kv_core::blocks_for_tokens(prompt_tokens, self.engine.shape().layout.block_tokens) as usize;
        if count == 0 || n == 0 {
            let message = format!("prefill of {id}: {prompt_tokens} prompt tokens and n = {n}; both must be positive");
            self.engine.emit(&Event::Error { message });
            return Ok(());
        }
        let model = match self.engine.model_prompt(&id, prompt_tokens, prompt_ids, 0) {
            Ok(model) => model,
            Err(message) => {
                self.engine.emit(&Event::Error { message: format!("prefill of {message}") });
                return Ok(());
            }
        };
        if self.side.prompts.iter().any(|p| p.id == id) {
            self.engine.emit(&Event::Error { message: format!("prefill of {id}: P is computing it already") });
            return Ok(());
        }
        let Some((blocks, freed)) = self.engine.allocate(count) else {
            self.engine.emit(&Event::Busy { id });
            return Ok(());
        };
        if let Some(prompt) = model {
            return self.prefill_model(id, prompt, n, consumer, blocks, freed);
        }
        let seed = pattern::seed(&self.engine.name, &id);
        // A prompt computed in chunks is filled chunk by chunk, each part on its own payload
        // thread, so that the first chunks are ready for their writes ahead early.
        let block_tokens = u64::from(self.engine.shape().layout.block_tokens.max(1));
        let part_blocks = match self.side.chunk {
            Some(chunk) if n == 1 => usize::try_from(chunk / block_tokens).unwrap_or(usize::MAX).max(1),
            _ => count,
        };
        let parts = blocks.len().div_ceil(part_blocks);
        for (part, part_of) in blocks.chunks(part_blocks).enumerate() {
            let freed = freed.iter().copied().filter(|b| part_of.contains(b)).collect();
            let work = Work::Fill { seed, blocks: part_of.to_vec(), freed, first: part * part_blocks };
            self.engine.payload.submit(Tag::Filled { id: id.clone(), part }, work);
        }
        // One GPU, one prompt at a time: this one starts when the GPU is done with those before.
        let compute = self.side.per_token.saturating_mul(u32::try_from(prompt_tokens).unwrap_or(u32::MAX));
        let start = self.side.gpu_free.max(Instant::now());
        let due = start + compute;
        self.side.gpu_free = due;
        let filled = vec![false; parts];
        let prompt = Prompt {
            id,
            prompt_tokens,
            n,
            consumer,
            blocks,
            start,
            due,
            part_blocks,
            filled,
            reported: (0, 0, 0),
            model: None,
            first: None,
        };
        self.side.prompts.push(prompt);
        Ok(())
    }

    /// Starts a prompt the model computes: in chunks of P's chunk size (the whole prompt for
    /// none), one after another on the payload threads, each part of the prompt's filling;
    /// the first checks the scrub of the blocks freed before.
    fn prefill_model(
        &mut self,
        id: String,
        prompt: Arc<[u32]>,
        n: u32,
        consumer: Option<Consumer>,
        blocks: Vec<BlockId>,
        freed: Vec<BlockId>,
    ) -> Result<()> {
        let block_tokens = u64::from(self.engine.shape().layout.block_tokens.max(1));
        let part_blocks = match self.side.chunk {
            Some(chunk) => usize::try_from(chunk / block_tokens).unwrap_or(usize::MAX).max(1),
            None => blocks.len(),
        };
        let parts = blocks.len().div_ceil(part_blocks);
        // The model's time is its own: nothing simulated to wait for.
        let now = Instant::now();
        let prompt = Prompt {
            id: id.clone(),
            prompt_tokens: prompt.len() as u64,
            n,
            consumer,
            blocks,
            start: now,
            due: now,
            part_blocks,
            filled: vec![false; parts],
            reported: (0, 0, 0),
            model: Some(prompt),
            first: None,
        };
        self.side.prompts.push(prompt);
        let work = self.compute_part(&id, 0, freed)?;
        self.engine.payload.submit(Tag::Filled { id, part: 0 }, work);
        Ok(())
    }

    /// The compute of part `part` of model prompt `id`: its chunk's tokens into its blocks.
    fn compute_part(&self, id: &str, part: usize, freed: Vec<BlockId>) -> Result<Work> {
        let prompt = self.side.prompts.iter().find(|p| p.id == id);
        let (prompt, ids) = prompt
            .and_then(|p| Some((p, p.model.clone()?)))
            .ok_or_else(|| anyhow!("compute of {id}, which P does not compute with its model"))?;
        let tokens = prompt.part_blocks * self.engine.shape().layout.block_tokens as usize;
        let (from, to) = ((part * tokens).min(ids.len()), ((part + 1) * tokens).min(ids.len()));
        let layers_of = (self.side.by_layer && prompt.n == 1).then(|| id.to_owned());
        Ok(Work::Compute { prompt: ids, blocks: prompt.blocks.clone(), freed, from, to, chunk: tokens, layers_of })
    }

    /// Tells the connector the blocks of the chunks computed by `now` and filled, and with a
    /// model computing layer by layer, the layers of the chunk in progress stored so far (a
    /// prompt of siblings is not written ahead: it exports at its end).
    fn progress(&mut self, now: Instant) -> Result<()> {
        let block_tokens = u64::from(self.engine.shape().layout.block_tokens.max(1));
        for i in 0..self.side.prompts.len() {
            let prompt = &self.side.prompts[i];
            let computed = (self.side.chunked_tokens(prompt, now) / block_tokens) as usize;
            let whole = computed.min(prompt.filled_blocks());
            if prompt.n != 1 {
                continue;
            }
            // The chunk's blocks whose every token the stored layers hold (the last block of the
            // prompt, whole or not, once the chunk reaches its end).
            let part = self.engine.pool.layers_stored(&prompt.id).and_then(|(end, layers)| {
                let end =
                    if end as u64 >= prompt.prompt_tokens { prompt.blocks.len() } else { end / block_tokens as usize };
                (end > whole).then_some((end, layers))
            });
            let step = part.map_or((whole, whole, 0), |(end, layers)| (end, whole, layers));
            // Each report extends the last: more blocks, more of them whole, or more layers.
            let (blocks, before) = (step.0, prompt.reported);
            if step == before || blocks < before.0 || whole < before.1 || (part.is_none() && whole == before.1) {
                continue;
            }
            let (id, consumer) = (RequestId::new(prompt.id.clone()), prompt.consumer.clone());
            let done = prompt.blocks[..blocks].to_vec();
            self.side.prompts[i].reported = step;
            let scheduler = self.connector.scheduler();
            match part {
                Some((_, layers)) => {
                    scheduler.handle_layer_progress(id, done, LayerProgress { whole, layers }, consumer)?
                }
                None => scheduler.handle_progress(id, done, consumer)?,
            }
        }
        Ok(())
    }

    /// A prompt is computed: exports its blocks, once per sibling.
    fn computed(&mut self, prompt: Prompt) -> Result<()> {
        // P is done now: what follows is the connector's path to D.
        let finished_at_ns = wall_ns();
        let Prompt { id, prompt_tokens, n, consumer, blocks, first, .. } = prompt;
        self.engine.pool.forget_layers(&id);
        // allocate() took one reference; each further sibling export holds its own.
        for _ in 1..n {
            self.engine.blocks.retain(&blocks);
        }
        let ids: Vec<String> = if n > 1 { (0..n).map(|i| format!("{i}_{id}")).collect() } else { vec![id.clone()] };
        let now = self.engine.now();
        let mut exported = Vec::with_capacity(ids.len());
        for export in ids {
            let remote = self.connector.scheduler().handle_finished(
                now,
                RequestId::new(export),
                blocks.clone(),
                kv_core::Prompt::len_only(prompt_tokens),
                consumer.clone(),
            )?;
            exported.push(Event::Exported { id: id.clone(), remote, finished_at_ns, first });
        }
        // Push: the ranks write (or send the completion) while the router hears of it; pull:
        // D reads once the router has told it, so the router hears first.
        if self.side.push {
            self.drain()?;
        }
        for event in &exported {
            self.engine.emit(event);
        }
        self.drain()
    }

    /// Carries the scheduler's events to the ranks and the pool until none is left.
    fn drain(&mut self) -> Result<()> {
        for event in self.poll()? {
            match event {
                // kv-engine hands the ranks their commands itself.
                PrefillEvent::ToWorker { rank, .. } => return Err(anyhow!("a command for rank {rank} was not sent")),
                PrefillEvent::Free { request, blocks, reason } => {
                    self.engine.release(&blocks)?;
                    let event = Event::Freed { id: request.as_str().to_owned(), reason, at_ns: wall_ns() };
                    self.engine.emit(&event);
                }
            }
        }
        Ok(())
    }
}
