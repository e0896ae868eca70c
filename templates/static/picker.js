// The fit picker: reads the chosen model's committed fit cells (fits/<model>.js registers them
// under window.VRAM_FITS) and shows, for the chosen card, weights, recipe, LoRA and micro-batch,
// the largest rank at each length and the longest listed length at each rank, with the words and
// colours `vram fit` uses and the commands that reproduce the answer.
(function () {
  "use strict";
  var form = document.getElementById("fit-picker");
  var out = document.getElementById("fit-answer");
  if (!form || !out) { return; }
  form.hidden = false;
  var root = form.getAttribute("data-root") || "";
  window.VRAM_FITS = window.VRAM_FITS || {};

  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    if (text !== undefined) { e.textContent = text; }
    return e;
  }
  function value(name) { return form.elements[name].value; }
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
    var batch = value("batch");
    var card = data.cards.filter(function (c) { return c.key === gpu; })[0];
    var key = [quant, fixes, setting, gpu].join("|") + (batch === "1" ? "" : "|" + batch);
    var cells = data.rows[key] || [];
    out.textContent = "";
    var what = data.model + " on " + (card ? card.name : gpu) + ", " + (quant === "4bit" ? "4-bit nf4" : "bf16") +
      ", " + (fixes === "none" ? "stock" : "the program's memory fixes") + ", LoRA " + setting +
      ", micro-batch " + batch;
    out.appendChild(el("h3", {id: "fit-answer-title"}, what));
    if (batch !== "1" && fixes !== "none") {
      out.appendChild(el("p", {"class": "warn"}, "A micro-batch with the program's memory fixes is unknown: " +
        "the chunked MLP and the kept logits work per sequence, so a batch is not one longer sequence."));
      return;
    }
    if (card) {
      out.appendChild(el("p", {"class": "meta"}, "Limit for peak allocated: " + card.limit_low_mib + "–" +
        card.limit_high_mib + " MiB."));
    }
    var wrap = el("div", {"class": "table-wrap"});
    var table = el("table", {"class": "fit", id: "fit-answer-table"});
    var head = el("tr");
    head.appendChild(el("th", {scope: "col"}, "Tokens"));
    head.appendChild(el("th", {scope: "col"}, "Largest rank that fits (tight)"));
    head.appendChild(el("th", {scope: "col"}, "Method"));
    table.appendChild(el("thead")).appendChild(head);
    var body = el("tbody");
    cells.forEach(function (c) {
      var tr = el("tr", {"data-len": String(c[0])});
      tr.appendChild(el("th", {scope: "row"}, String(c[0])));
      // Only a tight rank (none that fits for sure): its own colour, never the colour of "fits".
      var status = c[1] === null && c[2] ? "tight" : c[3];
      var td = el("td", {"class": "num fit-" + status, "data-label": c[6],
        title: data.model + " " + quant + " fixes " + fixes + " " + setting + " batch " + batch + " " + c[0] +
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
    cmd.appendChild(el("code", {}, "vram fit --model " + data.model + " --gpu " + quote(gpu) +
      (quant === "bf16" ? " --quant bf16" : " --quant 4bit") + " --fixes " + fixes +
      (batch === "1" ? "" : " --batch-size " + batch) + "\n" +
      "vram ceiling --model " + data.model + " --gpu " + quote(gpu) + " --rank 16" + flags +
      (batch === "1" ? "" : " --batch-size " + batch) + "   # the exact longest length at rank 16"));
    out.appendChild(el("p", {"class": "meta"}, "The same on the command line:"));
    out.appendChild(cmd);
  }

  function update() {
    var sel = form.elements.model;
    var model = sel.value, opt = sel.options[sel.selectedIndex];
    if (!model || !value("gpu")) { say("Choose a model and a card: the answer appears here."); return; }
    load(model, opt.getAttribute("data-slug"), show);
  }
  form.addEventListener("change", update);
  // A link can carry a choice: ?model=qwen2.5-7b&gpu=rtx-4090&quant=bf16 (what the page shows is
  // then what a visitor who chose it sees).
  var params = new URLSearchParams(window.location.search);
  ["model", "gpu", "quant", "fixes", "setting", "batch"].forEach(function (name) {
    var v = params.get(name), field = form.elements[name];
    if (v !== null && field && Array.prototype.some.call(field.options, function (o) { return o.value === v; })) {
      field.value = v;
    }
  });
  update();
})();
