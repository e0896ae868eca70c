// The fit picker: reads the chosen model's committed fit cells (fits/<model>.js registers them
// under window.VRAM_FITS) and shows, for the chosen card, weights, recipe, LoRA, micro-batch, checkpointing and optimizer,
// the largest rank at each length and the longest listed length at each rank, with the words and
// colours `vram fit` uses and the commands that reproduce the answer.
(function () {
  "use strict";
  var form = document.getElementById("fit-picker");
  var out = document.getElementById("fit-answer");
  if (!form || !out) { return; }
  form.hidden = false;
  var root = form.getAttribute("data-root") || "";
  // How a card known by its total alone gets its limit (derived.fits.derive in vram.json; the
  // same rule as `vram fit --gpu-mib`).
  var derive = JSON.parse(form.getAttribute("data-derive") || "null");
  window.VRAM_FITS = window.VRAM_FITS || {};

  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    if (text !== undefined) { e.textContent = text; }
    return e;
  }
  function value(name) { return form.elements[name].value; }
  function r1(x) { return Math.round(x * 10) / 10; }

  // A card typed by its total (MiB, as nvidia-smi shows it): its limit for peak allocated, as
  // `vram fit --gpu-mib TOTAL` derives it. Null when nothing (or nothing sensible) is typed.
  function typedCard() {
    var field = form.elements.gpu_mib;
    var total = field ? Number(field.value) : NaN;
    if (!derive || !field.value || !(total >= 1024 && total <= 2000000)) { return null; }
    var low = r1(total * derive.usable_low), high = r1(total * derive.usable_high);
    return {key: "gpu-" + total + "-mib", name: "a card of " + total + " MiB", total: total,
      limit_low_mib: r1((low - derive.context_high_mib) / derive.ratio_high),
      limit_high_mib: r1(Math.min((high - derive.context_low_mib) / derive.ratio_low, high))};
  }
  // The listed card whose limit lies at or below the typed card's at both ends, the largest such:
  // what fits it fits the typed card (and what is tight there is at least tight here).
  function below(cards, typed) {
    var best = null;
    cards.forEach(function (c) {
      if (c.limit_low_mib !== null && c.limit_high_mib !== null && c.limit_low_mib <= typed.limit_low_mib + 0.05 &&
          c.limit_high_mib <= typed.limit_high_mib + 0.05 && (!best || c.limit_low_mib > best.limit_low_mib)) {
        best = c;
      }
    });
    return best;
  }
  function quote(card) { return /^[a-z0-9.-]+$/.test(card) ? card : '"' + card + '"'; }

  function load(model, slug, then) {
    if (window.VRAM_FITS[model]) { then(window.VRAM_FITS[model]); return; }
    var s = el("script", {src: root + "fits/" + slug + ".js"});
    s.onload = function () { then(window.VRAM_FITS[model]); };
    s.onerror = function () { say("The figures of " + model + " could not be loaded (" + s.src + ")."); };
    document.head.appendChild(s);
  }
  function say(text) { out.textContent = ""; out.appendChild(el("p", {"class": "meta"}, text)); }

  function show(data) {
    var gpu = value("gpu"), quant = value("quant"), fixes = value("fixes"), setting = value("setting");
    var batch = value("batch"), optim = fixes === "none" ? value("optim") : "";
    var ckpt = form.elements.ckpt ? value("ckpt") !== "off" : true;
    // Several GPUs: one GPU's answer, the rows keyed as the one-GPU ones with the world after them.
    var gpus = form.elements.gpus ? value("gpus") : "1", strategy = form.elements.strategy ? value("strategy") : "fsdp";
    var world = gpus === "1" ? "" : "|g" + gpus + "-" + strategy;
    // FSDP with CPU offload: a strategy of the picker's, FSDP and --cpu-offload on the command line.
    var offload = strategy === "fsdp-offload", named = offload ? "fsdp" : strategy;
    var worldFlags = gpus === "1" ? "" : " --gpus " + gpus + " --strategy " + named + (offload ? " --cpu-offload" : "");
    var typed = typedCard(), proxy = typed ? below(data.cards, typed) : null;
    var same = proxy && Math.abs(proxy.limit_low_mib - typed.limit_low_mib) <= 0.05 &&
      Math.abs(proxy.limit_high_mib - typed.limit_high_mib) <= 0.05;
    if (typed) { gpu = proxy ? proxy.key : ""; }
    var card = typed || data.cards.filter(function (c) { return c.key === gpu; })[0];
    var where = typed ? "--gpu-mib " + typed.total : "--gpu " + quote(gpu);  // the card, as the commands take it
    // As ledger.site.fits_page.picker_key spells a row: the defaults leave their part out.
    var key = [quant, fixes, setting, gpu].join("|") + (batch === "1" && !optim ? "" : "|" + batch) +
      (optim ? "|" + optim : "") + (ckpt ? "" : "|nockpt") + world;
    var cells = data.rows[key] || [];
    out.textContent = "";
    var what = quant.indexOf("full-") === 0 ? data.model + " on " + (card ? card.name : gpu) +
      ", full fine-tuning (every weight trained), " + (quant === "full-fp32" ? "fp32 master weights" : "bf16 weights") +
      ", " + (fixes === "none" ? "stock" : "memory fixes " + fixes) + ", a training run with " + (optim || "adamw_torch") +
      "'s state, micro-batch " + batch + (ckpt ? "" : ", no gradient checkpointing") :
      data.model + " on " + (card ? card.name : gpu) + ", " + (quant === "4bit" ? "4-bit nf4" : "bf16") +
      ", " + (fixes === "none" ? "stock, a training run with " + (optim || "adamw_torch") + "'s state" :
        "the program's memory fixes, a training run as its measured runs") + ", LoRA " + setting +
      ", micro-batch " + batch + (ckpt ? "" : ", no gradient checkpointing");
    if (world) { what += ", each of " + gpus + " GPUs (" + named + (offload ? ", CPU offload" : "") + "), per GPU"; }
    out.appendChild(el("h3", {id: "fit-answer-title"}, what));
    // A recipe the shipped tables do not have: why, and the command that answers it.
    function elsewhere(why, flags) {
      out.appendChild(el("p", {"class": "warn"}, why));
      var pre = el("pre");
      pre.appendChild(el("code", {}, "vram fit --model " + data.model + " " + where + " --quant " + quant + flags));
      out.appendChild(pre);
    }
    var noCkpt = ckpt ? "" : " --no-gradient-checkpointing";
    if (world && (typed || strategy !== "fsdp" || fixes !== "none" || setting !== "plain" || batch !== "1" || optim ||
        !ckpt || quant === "bf16" || quant === "full-fp32")) {
      out.appendChild(el("p", {"class": "warn"}, "The tables for several GPUs have FSDP (FULL_SHARD), stock, micro-batch 1, " +
        "AdamW, of QLoRA with the plain adapter and of full fine-tuning in bf16" + (typed ? ", on the listed cards" : "") +
        ". The command line answers the rest from dry runs of one rank, run on your CPU" +
        (offload ? " (with CPU offload, the host RAM each GPU's process needs too)" : "") + ":"));
      var other = el("pre");
      other.appendChild(el("code", {}, quant.indexOf("full-") === 0 ?
        "vram estimate --model " + data.model + " " + where + " --method full --quant " + quant.slice(5) +
        " --seq-len 2048" + worldFlags + (batch === "1" ? "" : " --batch-size " + batch) + (optim ? " --optim " + optim : "") :
        "vram fit --model " + data.model + " " + where + " --quant " + quant + worldFlags +
        (fixes === "none" ? "" : " --fixes " + fixes) + (batch === "1" ? "" : " --batch-size " + batch) +
        (optim ? " --optim " + optim : "") + noCkpt));
      out.appendChild(other);
      return;
    }
    if (world && !(quant.indexOf("full-") === 0 ? (data.full || {})[quant.slice(5) + "|" + gpu + world] : data.rows[key])) {
      out.appendChild(el("p", {"class": "warn"}, "No figures of " + data.model + " on several GPUs here: the tables " +
        "have the models no listed card holds whole. The command line dry-runs one rank on your CPU:"));
      var none = el("pre");
      none.appendChild(el("code", {}, quant.indexOf("full-") === 0 ?
        "vram estimate --model " + data.model + " " + where + " --method full --quant bf16 --seq-len 2048" + worldFlags :
        "vram fit --model " + data.model + " " + where + " --quant " + quant + worldFlags));
      out.appendChild(none);
      return;
    }
    if (quant.indexOf("full-") === 0) {
      fullAnswer(data, card, gpu, where, quant.slice(5), fixes, setting, batch, optim, ckpt, typed, proxy, same, world,
        worldFlags);
      return;
    }
    if (data.settings && data.settings.indexOf(setting) < 0) {
      out.appendChild(el("p", {"class": "warn"}, data.model + " is a mixture of experts: LoRA on its fused expert " +
        "weights (peft's target_parameters) takes no " + (setting === "DoRA" ? "DoRA" : "dropout") + ". LoRA on " +
        "attention only takes it; the command line answers that from dry runs of it, run on your CPU:"));
      var attn = el("pre");
      attn.appendChild(el("code", {}, "vram estimate --model " + data.model + " " + where + " --quant " + quant +
        " --target-modules attn --seq-len 2048 --rank 16" + (setting === "DoRA" ? " --dora" : " --dropout 0.1")));
      out.appendChild(attn);
      return;
    }
    if (batch !== "1" && fixes !== "none") {
      elsewhere("A micro-batch with the program's memory fixes is not in these tables: the chunked MLP and the " +
        "kept logits work per sequence, so a batch is not one longer sequence. The command line answers it from " +
        "dry runs of that micro-batch, run on your CPU:", " --fixes all --batch-size " + batch + noCkpt);
      return;
    }
    if (!ckpt && fixes !== "none") {
      elsewhere("The program's memory fixes without gradient checkpointing are not in these tables (the program " +
        "runs them with it on). The command line answers them from dry runs of that recipe, run on your CPU:",
        " --fixes all" + noCkpt);
      return;
    }
    if (!ckpt && batch !== "1") {
      elsewhere("A micro-batch above 1 without gradient checkpointing is not in these tables; the command line " +
        "answers it, as one sequence of " + batch + " x the length (measured never below the batch):",
        " --batch-size " + batch + (optim ? " --optim " + optim : "") + noCkpt);
      return;
    }
    if (card) {
      out.appendChild(el("p", {"class": "meta"}, "Limit for peak allocated: " + card.limit_low_mib + "–" +
        card.limit_high_mib + " MiB" + (typed ? ", derived from the total as for the listed cards." : ".")));
    }
    if (typed && !proxy) {
      out.appendChild(el("p", {"class": "warn"}, "No listed card has a limit at or below this one's: run " +
        "`vram fit --model " + data.model + " --gpu-mib " + typed.total + "` for its answer."));
      return;
    }
    if (typed && !same) {
      out.appendChild(el("p", {"class": "meta", id: "fit-answer-proxy"}, "Answered as at least what the " +
        proxy.name + " fits (its limit, " + proxy.limit_low_mib + "–" + proxy.limit_high_mib + " MiB, lies at " +
        "or below this card's): the exact ranks are what `vram fit --gpu-mib " + typed.total + "` prints."));
    }
    var wrap = el("div", {"class": "table-wrap"});
    var table = el("table", {"class": "fit", id: "fit-answer-table"});
    var head = el("tr");
    head.appendChild(el("th", {scope: "col"}, "Tokens"));
    head.appendChild(el("th", {scope: "col"}, world ? "Largest rank that fits each GPU (tight)" :
      "Largest rank that fits (tight)"));
    head.appendChild(el("th", {scope: "col"}, "Method"));
    table.appendChild(el("thead")).appendChild(head);
    var body = el("tbody");
    cells.forEach(function (c) {
      if (typed && !same) {  // at least the listed card's ranks; where none fits there, nothing is known
        var words = c[1] !== null ? "≥ " + c[1] : c[3] === "unknown" ? "unknown" :
          "unknown (" + (c[2] ? "tight ≤ " + c[2] : "none") + " on the " + proxy.name + ")";
        c = [c[0], c[1], c[2], c[1] !== null ? "ok" : "unknown", true, c[5], words, c[7]];
      }
      var tr = el("tr", {"data-len": String(c[0])});
      tr.appendChild(el("th", {scope: "row"}, String(c[0])));
      // Only a tight rank (none that fits for sure): its own colour, never the colour of "fits".
      var status = c[1] === null && c[2] ? "tight" : c[3];
      var td = el("td", {"class": "num fit-" + status, "data-label": c[6],
        title: data.model + " " + quant + " fixes " + fixes + " " + setting + " batch " + batch +
          (optim ? " " + optim : "") + (ckpt ? "" : " no checkpointing") + " " + c[0] +
          " tokens on " + gpu + ": " + c[5] + (c[7].length ? "; measured nearby: " + c[7].join(", ") : "")}, c[6]);
      tr.appendChild(td);
      tr.appendChild(el("td", {}, c[5]));
      body.appendChild(tr);
    });
    table.appendChild(body);
    wrap.appendChild(table);
    out.appendChild(wrap);
    // The other question: the longest listed length at each rank.
    var longest = el("p", {id: "fit-answer-longest"});
    longest.appendChild(document.createTextNode("Longest listed length that fits, by rank: " + data.ranks.map(
      function (r) {
        var ok = cells.filter(function (c) { return c[1] !== null && c[1] >= r; });
        return "r" + r + ": " + (ok.length ? ok[ok.length - 1][0] + " tokens" : "none listed");
      }).join("; ") + "."));
    out.appendChild(longest);
    var flags = (quant === "bf16" ? " --quant bf16" : "") + (fixes === "all" ? " --fixes all" : "") +
      (setting === "dropout" ? " --dropout 0.1" : setting === "DoRA" ? " --dora" : "");
    var cmd = el("pre");
    if (world) {
      cmd.appendChild(el("code", {}, "vram fit --model " + data.model + " " + where + " --quant " + quant + worldFlags +
        "\nvram estimate --model " + data.model + " " + where + " --quant " + quant + " --rank 16 --seq-len 2048" +
        worldFlags + "   # one rank's figures at one length"));
      out.appendChild(el("p", {"class": "meta"}, "The same on the command line:"));
      out.appendChild(cmd);
      return;
    }
    cmd.appendChild(el("code", {}, "vram fit --model " + data.model + " " + where +
      (quant === "bf16" ? " --quant bf16" : " --quant 4bit") + " --fixes " + fixes +
      (batch === "1" ? "" : " --batch-size " + batch) + (optim ? " --optim " + optim : "") +
      (ckpt ? "" : " --no-gradient-checkpointing") + "\n" +
      "vram ceiling --model " + data.model + " " + where + " --rank 16" + flags +
      (batch === "1" ? "" : " --batch-size " + batch) + (optim ? " --optim " + optim : "") +
      (ckpt ? "" : " --no-gradient-checkpointing") +
      "   # the exact longest length at rank 16"));
    out.appendChild(el("p", {"class": "meta"}, "The same on the command line:"));
    out.appendChild(cmd);
  }

  // Full fine-tuning (every weight trained): the verdict and peak at each length, for the stock
  // training run with AdamW, as `vram fit --method full` answers it.
  function fullAnswer(data, card, gpu, where, precision, fixes, setting, batch, optim, ckpt, typed, proxy, same, world,
                      worldFlags) {
    var cmd = world ? "vram estimate --model " + data.model + " " + where + " --method full --quant " + precision +
      " --seq-len 2048" + worldFlags : "vram fit --model " + data.model + " " + where + " --method full --quant " + precision;
    function command(flags) {
      var pre = el("pre");
      pre.appendChild(el("code", {}, cmd + flags));
      out.appendChild(pre);
    }
    if (fixes !== "none" || setting !== "plain" || batch !== "1" || optim || !ckpt) {
      out.appendChild(el("p", {"class": "warn"}, "These tables have full fine-tuning's stock training run with " +
        "AdamW, micro-batch 1, gradient checkpointing on" + (setting !== "plain" ? " (LoRA's dropout and DoRA " +
        "have no meaning without an adapter)" : "") + ". The command line answers the rest from dry runs of it, " +
        "run on your CPU:"));
      command((fixes !== "none" ? " --fixes " + fixes : "") + (batch !== "1" ? " --batch-size " + batch : "") +
        (optim ? " --optim " + optim : "") + (ckpt ? "" : " --no-gradient-checkpointing"));
      return;
    }
    var cells = (data.full || {})[precision + "|" + gpu + (world || "")];
    if (!cells) {
      out.appendChild(el("p", {"class": "warn"}, "No full fine-tuning figures of " + data.model + " here; the " +
        "command line dry-runs them:"));
      command("");
      return;
    }
    if (card) {
      out.appendChild(el("p", {"class": "meta"}, "Limit for peak allocated: " + card.limit_low_mib + "–" +
        card.limit_high_mib + " MiB" + (typed ? ", derived from the total as for the listed cards." : ".")));
    }
    if (typed && !same) {
      out.appendChild(el("p", {"class": "meta"}, "Answered for the " + proxy.name + " (its limit lies at or below " +
        "this card's): what fits there fits here; the exact answer is the command's below."));
    }
    var wrap = el("div", {"class": "table-wrap"});
    var table = el("table", {"class": "fit", id: "fit-answer-table"});
    var head = el("tr");
    ["Tokens", "Verdict", world ? "Peak allocated per GPU (MiB)" : "Peak allocated (MiB)", "Method"].forEach(function (h) {
      head.appendChild(el("th", {scope: "col"}, h));
    });
    table.appendChild(el("thead")).appendChild(head);
    var body = el("tbody");
    var colour = {"fits": "ok", "tight": "tight", "won't fit": "none-fits", "unknown": "unknown"};
    cells.forEach(function (c) {
      var verdict = typed && !same && c[1] !== "fits" ? "unknown" : c[1];
      var tr = el("tr", {"data-len": String(c[0])});
      tr.appendChild(el("th", {scope: "row"}, String(c[0])));
      tr.appendChild(el("td", {"class": "num fit-" + (colour[verdict] || "unknown")}, verdict));
      tr.appendChild(el("td", {"class": "num"}, c[2] === null ? (c[1] === "won't fit" ? "past any device" : "") :
        Math.round(c[2]).toLocaleString("en") + (c[3] === null ? "" : " (≤ " + Math.round(c[3]).toLocaleString("en") +
        ")")));
      tr.appendChild(el("td", {}, c[4]));
      body.appendChild(tr);
    });
    table.appendChild(body);
    wrap.appendChild(table);
    out.appendChild(wrap);
    out.appendChild(el("p", {"class": "meta"}, "The same on the command line:"));
    command("");
  }

  function update() {
    var sel = form.elements.model;
    var model = sel.value, opt = sel.options[sel.selectedIndex];
    if (!model || (!value("gpu") && !typedCard())) { say("Choose a model and a card: the answer appears here."); return; }
    load(model, opt.getAttribute("data-slug"), show);
  }
  form.addEventListener("change", update);
  if (form.elements.gpu_mib) { form.elements.gpu_mib.addEventListener("input", update); }
  // A link can carry a choice: ?model=qwen2.5-7b&gpu=rtx-4090&quant=bf16 (what the page shows is
  // then what a visitor who chose it sees).
  var params = new URLSearchParams(window.location.search);
  ["model", "gpu", "quant", "fixes", "setting", "batch", "optim", "ckpt", "gpus", "strategy"].forEach(function (name) {
    var v = params.get(name), field = form.elements[name];
    if (v !== null && field && Array.prototype.some.call(field.options, function (o) { return o.value === v; })) {
      field.value = v;
    }
  });
  if (params.get("gpu_mib") && form.elements.gpu_mib && /^[0-9]+$/.test(params.get("gpu_mib"))) {
    form.elements.gpu_mib.value = params.get("gpu_mib");
  }
  update();
})();
